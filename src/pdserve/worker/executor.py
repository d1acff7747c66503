"""Runs the TP ranks of one engine: rank 0 in this process, ranks 1..N-1 as spawned children.

Engine process. `execute` sends a step to every rank and waits for all reports, bounded by the step
timeout; a rank that dies or stops answering raises `EngineDeadError` (the engine does not go on with
a partial group), and so does a rank found dead between steps (`check_ranks`). Children die with the thread that created them (PR_SET_PDEATHSIG), so create the
executor in a thread that lives as long as the engine. A rank whose connector has a report for the
next step says so between steps (rank 0 by a call, the others by an empty message on a pipe of their
own, read by one thread here): `reports_waiting` is set and `wake` ends the engine loop's sleep.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import multiprocessing.connection
import threading
import time
from datetime import timedelta
from typing import Callable

import msgspec
import torch.distributed as dist

from pdserve.config import EngineConfig
from pdserve.worker.messages import (DebugCall, DebugResult, RankReady, Shutdown, StepInput,
                                     StepOutput)
from pdserve.worker.worker import Worker, rank_main

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """A TP rank died or stopped answering; the engine cannot continue."""


class Executor:
    def __init__(self, config: EngineConfig, num_blocks: int, engine_id: str,
                 wake: Callable[[], None] = lambda: None):
        self.config = config
        self.tp_size = config.parallel.tensor_parallel_size
        self._wake = wake  # called on another thread
        self.reports_waiting = False  # a rank has a connector report for the next step
        self._procs: list[mp.Process] = []
        self._conns = []
        self._report_conns = []  # ranks 1..N-1: an empty message when their report has something
        self._report_thread: threading.Thread | None = None
        self._encoder = msgspec.msgpack.Encoder()
        self._out_decoder = msgspec.msgpack.Decoder(StepOutput)
        self._debug_decoder = msgspec.msgpack.Decoder(DebugResult)
        self.rank_agents = []
        store = None
        store_port = 0
        par = config.parallel
        if self.tp_size > 1:
            store = dist.TCPStore(par.dist_host, 0, self.tp_size, is_master=True,
                                  timeout=timedelta(seconds=par.dist_timeout_s),
                                  wait_for_workers=False)
            store_port = store.port
            ctx = mp.get_context("spawn")
            for rank in range(1, self.tp_size):
                parent, child = ctx.Pipe()
                report_parent, report_child = ctx.Pipe(duplex=False)
                proc = ctx.Process(target=rank_main, name=f"pdserve-rank{rank}", daemon=True,
                                   args=(config, rank, num_blocks, engine_id, store_port, child, report_child))
                proc.start()
                child.close()
                report_child.close()
                self._procs.append(proc)
                self._conns.append(parent)
                self._report_conns.append(report_parent)
        try:
            self.local = Worker(config, 0, num_blocks, engine_id, store_port, store,
                                on_report=self._rank_reported)
            self.rank_agents.append(self.local.rank_agent())
            ready_decoder = msgspec.msgpack.Decoder(RankReady)
            for rank, conn in enumerate(self._conns, start=1):
                ready = ready_decoder.decode(self._recv(rank, conn, par.dist_timeout_s + 120))
                if ready.error:
                    raise EngineDeadError(f"TP rank {rank} failed to start:\n{ready.error}")
                self.rank_agents.append(ready.agent)
        except BaseException:
            self.shutdown()
            raise
        self._store = store
        if self._report_conns:
            self._report_thread = threading.Thread(target=self._watch_reports, args=(list(self._report_conns),),
                                                   name="pdserve-rank-reports", daemon=True)
            self._report_thread.start()

    def _rank_reported(self) -> None:
        self.reports_waiting = True
        self._wake()

    def _watch_reports(self, conns: list) -> None:
        """Until every child rank has closed its end (it exited): each message wakes the engine,
        and so does a rank's end (`check_ranks` then says which rank died)."""
        while conns:
            for conn in mp.connection.wait(conns):
                try:
                    while conn.poll():
                        conn.recv_bytes()
                except (EOFError, OSError):
                    conns.remove(conn)
                    self._wake()
                    continue
                self._rank_reported()

    def _recv(self, rank: int, conn, timeout_s: float) -> bytes:
        deadline = time.monotonic() + timeout_s
        proc = self._procs[rank - 1]
        while not conn.poll(0.5):
            if not proc.is_alive():
                raise EngineDeadError(f"TP rank {rank} died (exit code {proc.exitcode})")
            if time.monotonic() > deadline:
                raise EngineDeadError(f"TP rank {rank} did not answer within {timeout_s:.0f} s")
        try:
            return conn.recv_bytes()
        except (EOFError, OSError) as e:
            raise EngineDeadError(f"TP rank {rank} closed its pipe: {e}") from e

    def _broadcast(self, msg) -> None:
        data = self._encoder.encode(msg)
        for rank, conn in enumerate(self._conns, start=1):
            try:
                conn.send_bytes(data)
            except (BrokenPipeError, OSError) as e:
                raise EngineDeadError(f"TP rank {rank} is gone: {e}") from e

    def execute(self, step: StepInput) -> list[StepOutput]:
        """Run one step on every rank; returns the outputs in rank order (rank 0 samples)."""
        self.reports_waiting = False  # what was announced before now comes up with this step
        self._broadcast(step)
        try:
            outputs = [self.local.execute(step)]
        except Exception:
            self.check_ranks(grace_s=1.0)  # a rank that died mid-step is the cause, not the collective
            raise
        for rank, conn in enumerate(self._conns, start=1):
            out = self._out_decoder.decode(self._recv(rank, conn, self.config.parallel.step_timeout_s))
            outputs.append(out)
        for out in outputs:
            if out.error:
                raise EngineDeadError(f"TP rank {out.rank} failed a step:\n{out.error}")
        return outputs

    def check_ranks(self, grace_s: float = 0.0) -> None:
        """Raise EngineDeadError naming a rank process that has exited (found between steps too).
        `grace_s`: how long a rank that is dying (its peers saw its sockets close) has to finish."""
        deadline = time.monotonic() + grace_s
        while True:
            for rank, proc in enumerate(self._procs, start=1):
                if not proc.is_alive():
                    raise EngineDeadError(f"TP rank {rank} died (exit code {proc.exitcode})")
            if time.monotonic() >= deadline:
                return
            time.sleep(0.05)

    def debug(self, name: str, *args) -> list[DebugResult]:
        call = DebugCall(name, list(args))
        self._broadcast(call)
        results = [self.local.debug(call)]
        for rank, conn in enumerate(self._conns, start=1):
            results.append(self._debug_decoder.decode(self._recv(rank, conn, 60)))
        return results

    def shutdown(self) -> None:
        for conn in self._conns:
            try:
                conn.send_bytes(self._encoder.encode(Shutdown()))
            except (BrokenPipeError, OSError):
                pass
        for proc in self._procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        for conn in self._conns:
            conn.close()
        if self._report_thread is not None:
            self._report_thread.join(timeout=5)  # ends when the ranks' ends close (they exited)
        for conn in self._report_conns:
            conn.close()
        self._procs, self._conns, self._report_conns = [], [], []
        local = getattr(self, "local", None)
        if local is not None:
            local.close()
            self.local = None
