"""The asyncio bridge to the engine: the engine and its step loop live in one dedicated thread.

Server process. Handlers call `add_request` (awaits the engine's validation, then returns a stream
of `RequestOutput` deltas) and `abort`; the event loop never waits on a model step. The thread
creates the engine itself, so the TP ranks (which die with the thread that spawned them) live exactly
as long as the loop. When the loop sleeps it blocks on its command queue; a pending P/D transfer
makes it wake up as often as the connector asks.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from typing import AsyncIterator, Callable

import msgspec

from pdserve.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.engine.rates import StepRates
from pdserve.health import Load
from pdserve.outputs import RequestOutput

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 1.0  # longest sleep of an idle loop (lease and quarantine timers need no finer)


class EngineDeadError(RuntimeError):
    pass


class RequestStream:
    """Deltas of one request, in order; ends after the finished delta (or an engine failure)."""

    def __init__(self, request_id: str):
        self.request_id = request_id
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.finished = False

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        while not self.finished:
            item = await self.queue.get()
            if isinstance(item, BaseException):
                self.finished = True
                raise item
            self.finished = item.finished
            yield item


class AsyncEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.engine: Engine | None = None
        self.error: str | None = None
        self.died = False  # the loop failed after the engine had started (the process should exit)
        # (load, warnings) as of the engine thread's last turn: /health reads it without waiting
        # for a step (a long one would make a busy instance look down)
        self.snapshot: tuple[Load, list[str]] | None = None
        self.rates = StepRates()  # measured on the engine thread, published with the load
        # (fn(engine), future or None); None stops the loop
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._exited = threading.Event()
        self._streams: dict[str, RequestStream] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pdserve-engine", daemon=True)

    # --- lifecycle ------------------------------------------------------------------------------

    async def start(self, timeout_s: float = 600.0) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread.start()
        ready = await asyncio.to_thread(self._ready.wait, timeout_s)
        if self.error:
            raise EngineDeadError(self.error)
        if not ready:
            raise EngineDeadError(f"engine did not start within {timeout_s:.0f} s")

    @property
    def is_ready(self) -> bool:
        return self._ready.is_set() and self.error is None and not self._exited.is_set()

    def wait_exited(self, timeout_s: float | None = None) -> bool:
        """Block (a plain thread) until the engine thread has ended."""
        return self._exited.wait(timeout_s)

    async def drain(self, timeout_s: float) -> None:
        """Wait (bounded) until the engine holds no lease for a reader and loads no KV: a
        producer told to stop keeps serving the reads it promised."""
        deadline = time.monotonic() + timeout_s
        while self.is_ready and time.monotonic() < deadline:
            try:
                if not await self.call(lambda e: e.connector.busy):
                    return
            except EngineDeadError:
                return
            await asyncio.sleep(0.05)
        if self.is_ready:
            logger.warning("drain: leases or KV loads still open after %.0f s; stopping anyway", timeout_s)

    async def stop(self, timeout_s: float = 30.0) -> None:
        self._commands.put(None)
        if self._thread.is_alive():
            await asyncio.to_thread(self._thread.join, timeout_s)

    # --- requests -------------------------------------------------------------------------------

    async def add_request(self, request_id: str, prompt_token_ids: list[int], params,
                          kv_transfer=None, cache_salt: str | None = None,
                          after: str | None = None) -> RequestStream:
        """Validated by the engine before this returns (InvalidRequestError propagates)."""
        stream = RequestStream(request_id)

        def add(engine: Engine):
            engine.add_request(request_id, prompt_token_ids, params, kv_transfer, cache_salt, after)
            self._streams[request_id] = stream
        try:
            await self.call(add)
        except asyncio.CancelledError:  # the caller left while the engine was adding it
            self.abort(request_id)
            raise
        return stream

    def abort(self, request_id: str) -> None:
        """Fire and forget; the engine frees the request's blocks on its next turn. Also for a
        request that ended but whose answer did not reach its client (a P/D hand-off's lease)."""
        self._commands.put((lambda engine: engine.abort(request_id), None))

    async def call(self, fn: Callable[[Engine], object]):
        """Run `fn(engine)` on the engine thread and return its result (or raise its exception).
        If the loop is gone, or goes away before running it, this raises EngineDeadError."""
        if not self.is_ready:
            raise EngineDeadError(self.error or "engine is not running")
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put((fn, done))
        if self._exited.is_set():  # the loop ended between the check and the put
            self._fail_commands()
        return await asyncio.wrap_future(done)

    # --- the engine thread ----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            try:
                self.engine = Engine(self.config)
            except BaseException as e:  # noqa: BLE001
                logger.exception("engine failed to start")
                self.error = f"engine failed to start: {e}"
                return
            self.engine.wake = lambda: self._commands.put((_noop, None))
            self._publish()
            self._ready.set()
            try:
                self._loop_forever()
            except BaseException as e:  # noqa: BLE001
                logger.exception("engine loop died")
                self.error = f"engine loop died: {e}"
                self.died = True
                self._fail_all(EngineDeadError(self.error))
            finally:
                self.engine.shutdown()
        finally:
            self._exited.set()
            self._ready.set()
            self._fail_commands()

    def _fail_commands(self) -> None:
        """Commands queued for a loop that will never run them fail instead of waiting forever."""
        error = EngineDeadError(self.error or "engine stopped")
        while True:
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                return
            if item is not None and item[1] is not None and not item[1].done():
                item[1].set_exception(error)

    def _loop_forever(self) -> None:
        engine = self.engine
        while True:
            timeout = 0.0 if engine.needs_step() else self._idle_wait()
            try:
                item = self._commands.get(timeout=timeout) if timeout > 0 else self._commands.get_nowait()
            except queue.Empty:
                item = ...
            commands = False
            while item is not ...:
                if item is None:
                    self._shutdown_requests()
                    return
                fn, done = item
                if done is not None and not done.set_running_or_notify_cancel():
                    item = self._next_command()
                    continue  # its caller is gone
                try:
                    result = fn(engine)
                    if done is not None:
                        done.set_result(result)
                except Exception as e:  # noqa: BLE001 - handed to the caller, or logged
                    if done is None:
                        logger.exception("engine command failed")
                    else:
                        done.set_exception(e)
                item = self._next_command()
                commands = True
            if commands:
                self._publish()
            computed, start = engine.scheduler.num_prompt_tokens_computed, time.monotonic()
            outputs = engine.step()
            self.rates.observe(engine.scheduler.num_prompt_tokens_computed - computed,
                               len(engine.scheduler.running), time.monotonic() - start)
            engine.scheduler.prefill_tokens_per_s = self.rates.prefill_tokens_per_s  # its stall budget's
            if outputs:
                self._dispatch(outputs)
            self._publish()

    def _publish(self) -> None:
        """One reference swap: readers on the event loop see the old or the new snapshot."""
        load = msgspec.structs.replace(self.engine.load(), prefill_tokens_per_s=self.rates.prefill_tokens_per_s,
                                       decode_step_s=self.rates.decode_step_s)
        self.snapshot = (load, self.engine.warnings())

    def _next_command(self):
        try:
            return self._commands.get_nowait()
        except queue.Empty:
            return ...

    def _idle_wait(self) -> float:
        timer = self.engine.wakeup_in()
        return IDLE_WAIT_S if timer is None else max(0.0005, min(IDLE_WAIT_S, timer))

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        pairs = []
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                del self._streams[out.request_id]
            pairs.append((stream, out))
        if pairs:
            self._loop.call_soon_threadsafe(_deliver, pairs)

    def _fail_all(self, error: BaseException) -> None:
        pairs = [(s, error) for s in self._streams.values()]
        self._streams.clear()
        if pairs and self._loop is not None:
            self._loop.call_soon_threadsafe(_deliver, pairs)

    def _shutdown_requests(self) -> None:
        for request_id in list(self._streams):
            self.engine.abort(request_id)
        self._dispatch(self.engine.step())
        self._fail_all(EngineDeadError("server is shutting down"))


def _noop(engine) -> None:
    pass


def _deliver(pairs) -> None:
    for stream, item in pairs:
        stream.queue.put_nowait(item)
