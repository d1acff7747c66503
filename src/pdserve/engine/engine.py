"""The engine of one instance: `add_request`, `step`, `abort`, driven by `LLM` or the server's loop.

Engine process (the server runs it in one dedicated thread). A step is schedule -> execute on the TP
ranks -> process the sampled tokens -> one call to the P/D connector (what was admitted, what the
ranks reported), whose one outcome the engine applies (`_apply`) to its scheduler and block pool,
and whose metadata goes to the ranks with the next step (docs/design.md, "The connector seam").
Blocks pinned for other instances' claims go back to the connector at once (`grant`).
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from typing import Callable

from pdserve.config import EngineConfig
from pdserve.engine.block_pool import BlockPool
from pdserve.engine.kv_events import KVEvents
from pdserve.engine.output_processor import OutputProcessor
from pdserve.engine.request import Request, RequestStatus, TransferState
from pdserve.engine.sampling_controls import logits_controls
from pdserve.engine.scheduler import Scheduler, SchedulerOutput
from pdserve.health import Load
from pdserve.kv_transfer.messages import ConnectorMetadata, Fingerprint
from pdserve.kv_transfer.outcomes import ConnectorOutcome, LoadOutcome, Pinned, StepIn
from pdserve.kv_transfer.params import FirstToken, KVTransferParams
from pdserve.kv_transfer.scheduler_side import NoConnector, SchedulerConnector
from pdserve.model.loader import weight_format
from pdserve.model import kv_dtype
from pdserve.model.parallel import check_tp_size, kv_head_range
from pdserve.model.spec import ModelSpec, resolve_dtype
from pdserve.outputs import RequestOutput, TokenLogprob
from pdserve.prefix_cache.hashing import wire_hash
from pdserve.sampling_params import InvalidRequestError, SamplingParams
from pdserve.text.tokenizer import Tokenizer
from pdserve.worker.executor import Executor
from pdserve.worker.messages import PromptLogprobs, StepInput, StepOutput

logger = logging.getLogger(__name__)
MAX_SALT_CHARS = 1024  # a cache_salt is hashed into every block of its request


class OverloadedError(RuntimeError):
    """This instance cannot take the request now (maps to 503 with Retry-After)."""


def new_engine_id() -> str:
    """Unique per process start: a restarted producer is a new peer."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


class Engine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.spec = ModelSpec.from_dir(config.model)
        tp_size = config.parallel.tensor_parallel_size
        check_tp_size(tp_size, self.spec.num_heads, self.spec.num_kv_heads)
        self.tokenizer = Tokenizer(config.model, config.chat_template)
        self.dtype = resolve_dtype(config.dtype, self.spec)
        self.engine_id = new_engine_id()
        self.num_blocks = config.cache.num_blocks or self._blocks_for_budget()
        capacity = self.num_blocks * config.cache.block_size
        self.max_model_len = min(config.max_model_len or self.spec.max_model_len,
                                 self.spec.max_model_len, capacity)
        if self.max_model_len < (config.max_model_len or self.spec.max_model_len):
            logger.warning("max_model_len lowered to %d: the KV cache (%d blocks) holds no more",
                           self.max_model_len, self.num_blocks)
        self.eos_token_ids = tuple(self.spec.eos_token_ids) or (
            (self.tokenizer.eos_token_id,) if self.tokenizer.eos_token_id is not None else ())
        self.pool = BlockPool(self.num_blocks, config.cache.block_size,
                              config.cache.enable_prefix_caching, model_key=self.model_key())
        self.kv_events = KVEvents(config.kv_events, self.engine_id, self.pool)
        # Called from other threads when work arrives for the engine (a side-channel reply, a rank's
        # report); the loop that drives the engine replaces it with a way to end its sleep.
        self.wake: Callable[[], None] = lambda: None
        self.executor = Executor(config, self.num_blocks, self.engine_id, wake=lambda: self.wake())
        self.connector = NoConnector()
        if config.kv_transfer is not None:
            self.connector = SchedulerConnector(config.kv_transfer, self.engine_id, self.fingerprint(),
                                                self.executor.rank_agents, wake=lambda: self.wake(),
                                                caches=self.pool.cached.__contains__)
        self.scheduler = Scheduler(config.scheduler, self.pool)
        self.output_processor = OutputProcessor(self.tokenizer, self.max_model_len)
        self._pending: list[RequestOutput] = []  # produced outside a step (first tokens, failures)
        self._metadata: ConnectorMetadata | None = None  # for the ranks, with the next step
        self._reschedule = False  # the last outcome may have made room for a queued request
        self._step_id = 0
        self.num_generated_tokens = 0
        self.num_prompt_tokens = 0

    def fingerprint(self) -> Fingerprint:
        """What a P/D peer must share with this engine before one reads the other's cache."""
        spec = self.spec  # the weights' format rides in `model`: a peer's mismatch names both
        weights = "mock" if self.config.mock_engine else weight_format(self.config.model, self.config.quantization)
        model = f"{spec.fingerprint()}+weights={weights}"  # a mock never pairs with a real engine
        return Fingerprint(model=model, dtype=str(self.dtype).replace("torch.", ""),
                           num_layers=spec.num_layers, num_kv_heads=spec.num_kv_heads,
                           head_dim=spec.head_dim, block_size=self.config.cache.block_size,
                           kv_cache_dtype=kv_dtype.resolve(self.config.cache.kv_cache_dtype, self.dtype))

    def model_key(self) -> str:
        """The fingerprint as the string hashed into every cached block (prefix_cache.hashing)."""
        fp = self.fingerprint()
        return ":".join(str(getattr(fp, f)) for f in fp.__struct_fields__)

    def _blocks_for_budget(self) -> int:
        tp = self.config.parallel.tensor_parallel_size
        heads = len(kv_head_range(0, tp, self.spec.num_kv_heads))
        kv_name = kv_dtype.resolve(self.config.cache.kv_cache_dtype, self.dtype)  # fp8: a scale per slot
        per_slot = self.spec.head_dim * kv_dtype.element_bytes(kv_name) + kv_dtype.scale_bytes(kv_name)
        per_block = 2 * self.spec.num_layers * heads * self.config.cache.block_size * per_slot
        return max(2, int(self.config.cache.kv_cache_gib * 2**30) // per_block)

    # --- requests -------------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    kv_transfer: KVTransferParams | None = None, cache_salt: str | None = None,
                    after: str | None = None) -> None:
        """Queue a request. Raises InvalidRequestError (naming the field) before allocating anything.
        `after`: a P/D consumer request with the same prompt whose KV this one waits for, to find
        the prompt in the prefix cache (the other samples of `n`)."""
        if request_id in self.scheduler.requests:
            raise InvalidRequestError("request_id", f"{request_id!r} is already running")
        if cache_salt is not None and not (isinstance(cache_salt, str) and 0 < len(cache_salt) <= MAX_SALT_CHARS):
            raise InvalidRequestError("cache_salt", f"must be a non-empty string of at most {MAX_SALT_CHARS} "
                                                    "characters")
        n = len(prompt_token_ids)
        if n == 0:
            raise InvalidRequestError("prompt", "must not be empty")
        if n >= self.max_model_len:
            raise InvalidRequestError(
                "prompt", f"is too long: {n} tokens, the context length is {self.max_model_len} "
                          "(prompt plus at least one generated token)")
        if any(not 0 <= t < self.spec.vocab_size for t in prompt_token_ids):
            raise InvalidRequestError("prompt", f"token ids must be in [0, {self.spec.vocab_size})")
        if params.n != 1:
            raise InvalidRequestError("n", "the engine runs one sequence per request; fan out above it")
        if kv_transfer is not None:
            kv_transfer.check_against(prompt_token_ids, self.config.cache.block_size,
                                      self.config.parallel.tensor_parallel_size, self.spec.num_heads,
                                      self.spec.num_kv_heads, self.spec.vocab_size)
            if kv_transfer.do_remote_prefill and params.prompt_logprobs is not None:
                raise InvalidRequestError("prompt_logprobs", "a P/D consumer has no prompt logits (the "
                                                             "producer computes them)")
            if kv_transfer.do_remote_prefill and params.logprobs is not None \
                    and kv_transfer.first_token.logprob is None:
                raise InvalidRequestError("kv_transfer_params.first_token_logprob",
                                          "is required when logprobs are requested (send the "
                                          "request to the producer with logprobs too)")
        controls = logits_controls(params, self.tokenizer, self.eos_token_ids, self.spec.vocab_size,
                                   producer=kv_transfer is not None and kv_transfer.do_remote_decode)
        self._check_capacity(n)
        self.connector.add_request(request_id, kv_transfer)  # the last check: nothing raises after it
        max_tokens = self.max_model_len - n
        if params.max_tokens is not None:
            max_tokens = min(max_tokens, params.max_tokens)
        request = Request(request_id, prompt_token_ids, params, self.eos_token_ids, max_tokens,
                          kv_transfer, cache_salt, after)
        request.logits_controls = controls
        self.output_processor.start(request)
        self.num_prompt_tokens += n
        self.scheduler.add(request)
        if request.transfer == TransferState.AWAITING_KV:
            self._emit_first_token(request)

    def _check_capacity(self, num_prompt_tokens: int) -> None:
        """A request that could not start even if everything running and queued here finished,
        because leases (blocks a remote reader has not read yet) and quarantine pin the rest, is
        refused now (503): waiting would not help; another instance might."""
        need = self.pool.blocks_needed(num_prompt_tokens + 1)
        pinned = self.connector.num_leased_blocks() + self.pool.num_quarantined_blocks
        if need > self.num_blocks - pinned:
            raise OverloadedError(
                f"{pinned} of {self.num_blocks} KV blocks are held for remote readers or quarantined; "
                f"the prompt needs {need}")

    def _emit_first_token(self, request: Request) -> None:
        """P/D consumer: the producer's first token is this request's first output, sent at once."""
        first = request.kv_transfer.first_token
        lp = None
        if request.logprobs is not None and first.logprob is not None:
            lp = TokenLogprob(first.token_id, first.logprob,
                              list(first.top_logprobs) if first.top_logprobs is not None else None)
        out, status = self.output_processor.append(request, first.token_id, lp)
        self.num_generated_tokens += 1
        self._pending.append(out)
        if status is not None:  # max_tokens 1, or a stop of this request: the lease is released at once
            self._finish(request, status)

    def abort(self, request_id: str) -> bool:
        """Its caller will not deliver the request's answer. One that already ended in a P/D
        hand-off gives its lease back (unless a consumer holds it): nobody has its params."""
        request = self.scheduler.requests.get(request_id)
        if request is None:
            return self.connector.release_undelivered(request_id)
        if not self.connector.abort(request_id):  # else: it ends once every rank's READ has
            self._end(request, RequestStatus.FINISHED_ABORTED)
        return True

    def reset_prefix_cache(self) -> int:
        """vLLM's: forget every cached block (published as AllBlocksCleared); how many there were."""
        return self.pool.reset_prefix_cache()

    def _end(self, request: Request, status: RequestStatus, error: str | None = None) -> None:
        """End a request outside a step (aborted, or failed with an error the client sees)."""
        self._finish(request, status)
        self._pending.append(RequestOutput(request.request_id, [], "", None, finished=True,
                                           finish_reason=status.value, error=error,
                                           num_prompt_tokens=request.num_prompt_tokens,
                                           arrival_time=request.arrival_time,
                                           scheduled_time=request.scheduled_time))

    def _finish(self, request: Request, status: RequestStatus) -> dict | None:
        """Every request ends here. A P/D producer's hand-off keeps the prompt's blocks under a
        lease and returns the `kv_transfer_params` of its answer."""
        handoff = None
        if request.transfer == TransferState.HANDED_OFF:
            first = request.logprobs[0] if request.logprobs else None
            full = request.num_prompt_tokens // self.pool.block_size
            handoff = self.connector.hand_off(
                request.request_id, request.prompt_token_ids, request.block_ids,
                FirstToken(request.output_token_ids[0], first.logprob if first else None,
                           tuple(first.top) if first and first.top is not None else None),
                tuple(wire_hash(h) for h in self.pool.block_hashes(request, full)), request.num_cached_tokens)
        if handoff:  # its lease's blocks are freed later: as a spare copy, or kept (kept wins, as
            # for any request: left undecided, a later spare copy of a shared prefix would demote them)
            self.pool.mark(handoff.block_ids, spare=request.spare_copy)
        self.scheduler.finish(request, status, handoff.block_ids if handoff else ())
        self.connector.request_finished(request.request_id)
        return handoff.params if handoff else None

    def _apply(self, outcome: ConnectorOutcome) -> list[Pinned]:
        """Carry out what the connector decided, in the order outcomes.py documents; the blocks
        pinned for its claims, for the connector to grant."""
        if outcome.free_blocks:
            self.pool.release(outcome.free_blocks)
        for until, block_ids in outcome.quarantine:
            self.pool.quarantine_blocks(block_ids, until)
        for o in outcome.loads:
            request = self.scheduler.requests.get(o.request_id)
            if request is not None:  # else it ended while the decision was on its way
                self._apply_load(request, o)
        # another instance's producer claims blocks this one caches
        return [Pinned(pin.claim_id, self.pool.pin(pin.block_hashes, pin.spare)) for pin in outcome.pins]

    def _apply_load(self, request: Request, o: LoadOutcome) -> None:
        if o.quarantine_blocks:  # a READ may still land in them (never in shared cached blocks)
            self.pool.quarantine_blocks(list(o.quarantine_blocks), o.quarantine_until)
            in_doubt = set(o.quarantine_blocks)
            request.block_ids = [b for b in request.block_ids if b not in in_doubt]
        if o.state in (TransferState.KV_LOADED, TransferState.RECOMPUTING):
            self.scheduler.load_ended(request, o.state, o.num_blocks)
        elif o.state == TransferState.ABORTED:
            self._end(request, RequestStatus.FINISHED_ABORTED)
        else:
            self._end(request, RequestStatus.FINISHED_ERROR, o.message)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0 or bool(self._pending)

    def needs_step(self) -> bool:
        """A step would advance something now (the server loop sleeps otherwise). Queued requests
        alone do not count: each new request gets a step when it arrives, and one that could not be
        admitted waits for blocks to come back, which happens in a step or at a timer, so an
        overloaded engine does not spin; an outcome that freed blocks or sent a request back to the
        queue gets one. Ranks with a report to collect wake the loop."""
        return bool(self._pending or self.scheduler.running or self._reschedule or self._metadata is not None
                    or self.executor.reports_waiting) or self.connector.needs_step()

    def wakeup_in(self) -> float | None:
        """Seconds until a timer (the connector's, or quarantined blocks coming back) needs a step."""
        now = time.monotonic()
        timers = [t for t in (self.connector.wakeup_in(now), self.pool.next_quarantine_release(now))
                  if t is not None]
        return min(timers, default=None)

    # --- one step -------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        outputs, self._pending = self._pending, []
        self.pool.release_quarantine(time.monotonic())
        sched = self.scheduler.schedule()
        results = self._execute(sched)
        for scored in results[0].prompt_logprobs if results else ():
            self._record_prompt_logprobs(scored)
        for token in results[0].sampled if results else ():
            request = self.scheduler.requests.get(token.request_id)
            if request is None or request.is_finished:
                continue
            lp = TokenLogprob(token.token_id, token.logprob, token.top_logprobs) \
                if request.logprobs is not None else None
            out, status = self.output_processor.append(request, token.token_id, lp)
            self.num_generated_tokens += 1
            if status is not None:
                out.kv_transfer_params = self._finish(request, status)
            outputs.append(out)
        outcome, self._metadata = self.connector.step(StepIn(
            sched.remote_loads, sched.remote_pulls, [r.connector for r in results]))
        pinned = self._apply(outcome)
        if pinned:  # claims answered now: a claimer waits one step of this engine at most
            self._metadata = self.connector.grant(pinned, self._metadata)
        self._reschedule = bool(outcome) and bool(self.scheduler.waiting)
        return outputs + self._drain_pending()

    def _record_prompt_logprobs(self, scored: PromptLogprobs) -> None:
        """By position, so a recomputed prompt (after preemption) writes the same entries again."""
        request = self.scheduler.requests.get(scored.request_id)
        if request is None or request.prompt_logprobs is None:
            return
        for i, (lp, rank, top) in enumerate(zip(scored.logprobs, scored.ranks, scored.top)):
            pos = scored.start_pos + i
            request.prompt_logprobs[pos] = TokenLogprob(request.prompt_token_ids[pos], lp, top, rank)

    def _execute(self, sched: SchedulerOutput) -> list[StepOutput]:
        """Run the step on the ranks with the connector's metadata; skipped (no reports) when they
        have nothing to compute, hear or tell."""
        meta, self._metadata = self._metadata, None
        if sched.is_empty and not sched.finished_request_ids and meta is None \
                and not self.executor.reports_waiting:
            self.executor.check_ranks()  # an idle engine finds a dead rank too (raises)
            return []
        self._step_id += 1
        results = self.executor.execute(StepInput(
            step_id=self._step_id, chunks=sched.chunks, new_requests=sched.new_requests,
            finished_request_ids=sched.finished_request_ids, connector=meta))
        self.scheduler.advance(sched)
        return results

    def _drain_pending(self) -> list[RequestOutput]:
        pending, self._pending = self._pending, []
        return pending

    # --- introspection ----------------------------------------------------------------------------

    def warnings(self) -> list[str]:
        """Conditions an operator must know about (shown by /health and /metrics)."""
        return list(self.connector.warnings)

    def load(self) -> Load:
        """What a router weighs (reported by /health): queue and KV use, and where producers may
        claim blocks this instance caches."""
        return Load(num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
                    num_waiting_for_remote_kv=len(self.scheduler.loading),
                    kv_cache_usage=1 - self.pool.num_free_blocks / self.num_blocks,
                    num_leased_blocks=self.connector.num_leased_blocks(), kv_holder=self.connector.holder(),
                    max_prefill_stall_s=self.scheduler.config.max_prefill_stall_s)

    def stats(self, drain: bool = False) -> dict:
        """Counts for /metrics; `drain` also hands over the connector's new per-transfer records."""
        stats = {
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "num_waiting_for_remote_kv": len(self.scheduler.loading),
            "num_blocks": self.num_blocks,
            "num_free_blocks": self.pool.num_free_blocks,
            "num_spare_blocks": self.pool.num_spare_blocks,
            "num_quarantined_blocks": self.pool.num_quarantined_blocks,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_prompt_tokens_computed": self.scheduler.num_prompt_tokens_computed,
            "num_prefix_cache_queries": self.scheduler.num_prefix_cache_queries,
            "num_prefix_cache_hits": self.scheduler.num_prefix_cache_hits,
            "num_generated_tokens": self.num_generated_tokens,
        }
        kv = self.connector.stats(drain)
        if kv is not None:
            stats["kv_transfer"] = kv
        return stats

    def shutdown(self) -> None:
        self.kv_events.close()
        self.connector.close()
        self.executor.shutdown()
