"""A request inside the engine and its two lifecycles, each one enum with its legal transitions in
one place: scheduling (`RequestStatus`, here) and its part in P/D (`TransferState`, shared with the
connector's loads: kv_transfer/transfer_state.py).

Engine process. The scheduler owns requests; a request owns its block ids until it finishes (or, on
a P/D producer, until its prompt's blocks are handed to a lease by the connector).
"""

from __future__ import annotations

import enum
import time

from pdserve.kv_transfer.params import KVTransferParams
from pdserve.kv_transfer.transfer_state import TransferState, check_transition
from pdserve.outputs import TokenLogprob
from pdserve.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued for (re)prefill
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"  # P/D consumer: blocks allocated, KV in flight
    RUNNING = "running"
    PREEMPTED = "preempted"  # blocks taken back; will recompute from the start
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def finished(self) -> bool:
        return self in _FINISHED


_FINISHED = {RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
             RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR}
_TRANSITIONS = {
    RequestStatus.WAITING: {RequestStatus.RUNNING, RequestStatus.WAITING_FOR_REMOTE_KV} | _FINISHED,
    RequestStatus.WAITING_FOR_REMOTE_KV: {RequestStatus.RUNNING, RequestStatus.WAITING} | _FINISHED,
    RequestStatus.RUNNING: {RequestStatus.PREEMPTED} | _FINISHED,
    RequestStatus.PREEMPTED: {RequestStatus.RUNNING} | _FINISHED,
}


class Request:
    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 eos_token_ids: tuple[int, ...], max_tokens: int,
                 kv_transfer: KVTransferParams | None = None, cache_salt: str | None = None,
                 after: str | None = None):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.max_tokens = max_tokens  # resolved against the context length
        self.stop_token_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            self.stop_token_ids.update(eos_token_ids)
        self.kv_transfer = kv_transfer
        self.cache_salt = cache_salt  # its blocks are hashed with it: other salts never share them
        self.status = RequestStatus.WAITING
        self.output_token_ids: list[int] = []
        self.logprobs: list[TokenLogprob] | None = [] if params.logprobs is not None else None
        # each prompt token's logprob (None for the first, which nothing predicts), by position
        self.prompt_logprobs: list[TokenLogprob | None] | None = \
            [None] * len(self.prompt_token_ids) if params.prompt_logprobs is not None else None
        self.after = after  # a request whose remote KV this one waits for (a sample of the same prompt)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens not computed: cache hits at first admission, a pull's reads
        self.block_ids: list[int] = []
        self.block_hashes: list[bytes] = []  # content hashes of its full blocks so far (block_pool)
        self.num_registered_blocks = 0  # of its blocks, how many the prefix cache has considered
        self.arrival_time = time.monotonic()
        self.scheduled_time: float | None = None  # when it first ran (vLLM's queue time ends there)
        self.sent_to_workers = False  # the sampler on rank 0 knows this request
        self.pull_tried = False  # a producer request asked holders for its uncached blocks once
        self.transfer = TransferState.initial(kv_transfer)
        self.stop_reason: str | int | None = None
        self.logits_controls = None  # for rank 0's sampler (engine/sampling_controls.py), set by the engine
        # detokenization state (see text/detokenizer.py)
        self.detok = None
        self.output_text = ""
        self.num_emitted_chars = 0

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def spare_copy(self) -> bool:
        """The proxy said another instance keeps this prompt's KV: its blocks are reused first."""
        return self.kv_transfer is not None and self.kv_transfer.spare_copy

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def move_to(self, status: RequestStatus) -> None:
        if status not in _TRANSITIONS.get(self.status, ()):
            raise AssertionError(f"request {self.request_id}: illegal {self.status} -> {status}")
        if status == RequestStatus.RUNNING and self.scheduled_time is None:
            self.scheduled_time = time.monotonic()
        self.status = status

    def move_transfer_to(self, state: TransferState) -> None:
        """Only to the states the engine sees: HANDED_OFF, and how a load ended (KV_LOADED,
        RECOMPUTING); the connector's load walks the rest."""
        check_transition(f"request {self.request_id}", self.transfer, state)
        self.transfer = state

    def __repr__(self) -> str:
        return (f"Request({self.request_id}, {self.status.value}, prompt={self.num_prompt_tokens}, "
                f"out={len(self.output_token_ids)}, computed={self.num_computed_tokens})")
