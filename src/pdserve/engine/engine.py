"""The engine of one instance: `add_request`, `step`, `abort`, driven by `LLM` or the server's loop.

Engine process (the server runs it in one dedicated thread). A step is schedule -> execute on the TP
ranks -> process the sampled tokens; the P/D connector (when configured) adds its metadata to each
step and turns the ranks' reports into request transitions.
"""

from __future__ import annotations

import logging
import os
import socket
import uuid
from typing import Callable

import torch

from pdserve.config import EngineConfig
from pdserve.engine.block_pool import BlockPool
from pdserve.engine.output_processor import OutputProcessor
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.scheduler import Scheduler
from pdserve.kv_transfer.params import KVTransferParams
from pdserve.model.parallel import check_tp_size, kv_head_range
from pdserve.model.spec import ModelSpec, resolve_dtype
from pdserve.outputs import RequestOutput, TokenLogprob
from pdserve.sampling_params import InvalidRequestError, SamplingParams
from pdserve.text.tokenizer import Tokenizer
from pdserve.worker.executor import Executor
from pdserve.worker.messages import StepInput

logger = logging.getLogger(__name__)


def new_engine_id() -> str:
    """Unique per process start: a restarted producer is a new peer."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


class Engine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.spec = ModelSpec.from_dir(config.model)
        tp_size = config.parallel.tensor_parallel_size
        check_tp_size(tp_size, self.spec.num_heads, self.spec.num_kv_heads)
        self.tokenizer = Tokenizer(config.model)
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
                              config.cache.enable_prefix_caching)
        self.executor = Executor(config, self.num_blocks, self.engine_id)
        self.connector = None
        if config.kv_transfer is not None:
            from pdserve.kv_transfer.scheduler_side import SchedulerConnector
            self.connector = SchedulerConnector(self, config.kv_transfer, self.executor.rank_agents)
        self.scheduler = Scheduler(config.scheduler, self.pool, self.connector)
        self.output_processor = OutputProcessor(self.tokenizer, self.max_model_len)
        self._pending: list[RequestOutput] = []  # produced outside a step (first tokens, failures)
        # Called from other threads when work arrives for the engine (a side-channel reply); the
        # loop that drives the engine replaces it with a way to end its sleep.
        self.wake: Callable[[], None] = lambda: None
        self._step_id = 0
        self.num_generated_tokens = 0
        self.num_prompt_tokens = 0

    def _blocks_for_budget(self) -> int:
        tp = self.config.parallel.tensor_parallel_size
        heads = len(kv_head_range(0, tp, self.spec.num_kv_heads))
        elem = torch.empty(0, dtype=self.dtype).element_size()
        per_block = 2 * self.spec.num_layers * heads * self.config.cache.block_size \
            * self.spec.head_dim * elem
        return max(2, int(self.config.cache.kv_cache_gib * 2**30) // per_block)

    # --- requests -------------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    kv_transfer: KVTransferParams | None = None) -> None:
        """Queue a request. Raises InvalidRequestError (naming the field) before allocating anything."""
        if request_id in self.scheduler.requests:
            raise InvalidRequestError("request_id", f"{request_id!r} is already running")
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
            if self.connector is None and (kv_transfer.do_remote_prefill or kv_transfer.do_remote_decode):
                raise InvalidRequestError("kv_transfer_params",
                                          "this instance was started without a KV transfer connector")
            kv_transfer.check_against(prompt_token_ids, self.config.cache.block_size,
                                      self.config.parallel.tensor_parallel_size, self.spec.num_heads,
                                      self.spec.num_kv_heads, self.spec.vocab_size)
            if kv_transfer.do_remote_prefill and params.logprobs is not None \
                    and kv_transfer.first_token.logprob is None:
                raise InvalidRequestError("kv_transfer_params.first_token_logprob",
                                          "is required when logprobs are requested (send the "
                                          "request to the producer with logprobs too)")
            if kv_transfer.do_remote_prefill:
                self.connector.claim(kv_transfer)
        max_tokens = self.max_model_len - n
        if params.max_tokens is not None:
            max_tokens = min(max_tokens, params.max_tokens)
        request = Request(request_id, prompt_token_ids, params, self.eos_token_ids, max_tokens,
                          kv_transfer)
        self.output_processor.start(request)
        self.num_prompt_tokens += n
        self.scheduler.add(request)
        if self.connector is not None and self.connector.wants_remote_kv(request):
            self._emit_first_token(request)

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
        if status is not None:  # only if the proxy forwarded a request the producer should have ended
            self.scheduler.finish(request, status)

    def abort(self, request_id: str) -> bool:
        request = self.scheduler.requests.get(request_id)
        if request is None:
            return False
        if self.connector is not None and self.connector.abort_load(request):
            return True  # blocks are freed once every rank's READ has ended
        self.finish_aborted(request)
        return True

    def finish_aborted(self, request: Request) -> None:
        """End an aborted request (called later for one whose abort waited for its KV reads)."""
        self.scheduler.finish(request, RequestStatus.FINISHED_ABORTED)
        self._pending.append(RequestOutput(request.request_id, [], "", None, finished=True,
                                           finish_reason="abort",
                                           num_prompt_tokens=request.num_prompt_tokens))

    def fail_request(self, request: Request, message: str) -> None:
        """End one request with an error the client sees (the engine goes on)."""
        self.scheduler.finish(request, RequestStatus.FINISHED_ERROR)
        self._pending.append(RequestOutput(request.request_id, [], "", None, finished=True,
                                           finish_reason="error", error=message,
                                           num_prompt_tokens=request.num_prompt_tokens))

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0 or bool(self._pending)

    def needs_step(self) -> bool:
        """A step would advance something now (the server loop sleeps otherwise). Queued requests
        alone do not count: each new request gets a step when it arrives, and one that could not be
        admitted waits for blocks to come back, which happens in a step or at a connector timer,
        so an overloaded engine does not spin."""
        if self._pending or self.scheduler.running:
            return True
        return self.connector is not None and self.connector.needs_step()

    # --- one step -------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        outputs, self._pending = self._pending, []
        if self.connector is not None:
            self.connector.tick()
        sched = self.scheduler.schedule()
        meta = self.connector.build_metadata() if self.connector is not None else None
        if sched.is_empty and not sched.finished_request_ids and meta is None:
            return outputs + self._drain_pending()
        self._step_id += 1
        results = self.executor.execute(StepInput(
            step_id=self._step_id, chunks=sched.chunks, new_requests=sched.new_requests,
            finished_request_ids=sched.finished_request_ids, connector=meta))
        self.scheduler.advance(sched)
        for token in results[0].sampled:
            request = self.scheduler.requests.get(token.request_id)
            if request is None or request.is_finished:
                continue
            lp = TokenLogprob(token.token_id, token.logprob, token.top_logprobs) \
                if request.logprobs is not None else None
            hand_off = self.connector is not None and self.connector.is_producer(request)
            out, status = self.output_processor.append(request, token.token_id, lp, hand_off)
            self.num_generated_tokens += 1
            if status is not None:
                self.scheduler.finish(request, status)
                if self.connector is not None:
                    out.kv_transfer_params = self.connector.take_transfer_params(request)
            outputs.append(out)
        if self.connector is not None:
            self.connector.process_reports([r.connector for r in results])
        return outputs + self._drain_pending()

    def _drain_pending(self) -> list[RequestOutput]:
        pending, self._pending = self._pending, []
        return pending

    # --- introspection ----------------------------------------------------------------------------

    def stats(self, drain: bool = False) -> dict:
        """Counts for /metrics; `drain` also hands over the connector's new per-transfer records."""
        stats = {
            "num_running": len(self.scheduler.running),
            "num_waiting": sum(1 for r in self.scheduler.waiting),
            "num_waiting_for_remote_kv": sum(
                1 for r in self.scheduler.requests.values()
                if r.status == RequestStatus.WAITING_FOR_REMOTE_KV),
            "num_blocks": self.num_blocks,
            "num_free_blocks": self.pool.num_free_blocks,
            "num_quarantined_blocks": self.pool.num_quarantined_blocks,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_generated_tokens": self.num_generated_tokens,
        }
        if self.connector is not None:
            stats["kv_transfer"] = self.connector.stats(drain)
        return stats

    def shutdown(self) -> None:
        if self.connector is not None:
            self.connector.close()
        self.executor.shutdown()
