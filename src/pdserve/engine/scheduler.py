"""Continuous batching with a token budget per step, chunked prefill, prefix caching and preemption.

Engine process, once per step: `schedule` decides which tokens of which requests the ranks compute,
`advance` records what was computed. Running requests go first (oldest first), then waiting ones
while budget, sequence slots and blocks last. When a running request needs a block and none is free,
the most recently admitted running request is preempted (its blocks freed, recomputed later).
P/D consumer requests are admitted to WAITING_FOR_REMOTE_KV: blocks allocated, never scheduled until
the engine applies how the connector says their load ended (`load_ended`: loaded, or recompute here).
"""

from __future__ import annotations

import dataclasses
from collections import deque

from pdserve.config import SchedulerConfig
from pdserve.engine.block_pool import BlockPool
from pdserve.engine.request import Request, RequestStatus, TransferState
from pdserve.engine.sampling_controls import with_history
from pdserve.kv_transfer.outcomes import RemoteLoad, RemotePull
from pdserve.prefix_cache.hashing import wire_hash
from pdserve.worker.messages import GrammarSpec, NewRequest, SamplingSpec, ScheduledChunk


@dataclasses.dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk]
    new_requests: list[NewRequest]
    finished_request_ids: list[str]
    num_preempted: int = 0
    remote_loads: list[RemoteLoad] = dataclasses.field(default_factory=list)  # admitted to
    # WAITING_FOR_REMOTE_KV this step, for the connector
    remote_pulls: list[RemotePull] = dataclasses.field(default_factory=list)  # ... producer requests
    # that READ prompt blocks from a holder

    @property
    def is_empty(self) -> bool:
        return not self.chunks


class Scheduler:
    def __init__(self, config: SchedulerConfig, pool: BlockPool):
        self.config = config
        self.pool = pool
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.loading: list[Request] = []  # WAITING_FOR_REMOTE_KV
        self._finished_ids: list[str] = []  # since the last step, for the sampler on rank 0
        self.num_preemptions = 0
        self.num_prompt_tokens_computed = 0  # by this instance's model (not cached, not transferred)
        self.num_prefix_cache_queries = 0  # prompt tokens looked up in the prefix cache (vLLM's)
        self.num_prefix_cache_hits = 0  # ... and found there
        self.prefill_tokens_per_s = 0.0  # measured by the loop driving the engine (engine/rates.py)

    # --- admission and removal ----------------------------------------------------------------

    def add(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish(self, request: Request, status: RequestStatus, keep_block_ids: list[int] = ()) -> None:
        """End a request and release its blocks, except `keep_block_ids` (a P/D hand-off's, which
        now belong to a lease)."""
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status == RequestStatus.WAITING_FOR_REMOTE_KV:
            self.loading.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.move_to(status)
        keep = set(keep_block_ids)
        release = [b for b in request.block_ids if b not in keep]
        if release:
            self.pool.release(release, spare=request.spare_copy)
        request.block_ids = []
        self.requests.pop(request.request_id, None)
        if request.sent_to_workers:
            self._finished_ids.append(request.request_id)

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    @property
    def _num_seqs(self) -> int:
        """What `max_num_seqs` bounds at admission: running requests and those loading remote KV
        (they run as soon as their KV lands)."""
        return len(self.running) + len(self.loading)

    # --- one step -------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        prefill_budget = self._prefill_budget()  # of those, prompt tokens (a stream's next token is not)
        chunks: list[ScheduledChunk] = []
        new_requests: list[NewRequest] = []
        remote_loads: list[RemoteLoad] = []
        remote_pulls: list[RemotePull] = []
        preempted = 0

        for request in list(self.running):
            if budget == 0:
                break
            if request.status != RequestStatus.RUNNING:  # preempted earlier in this loop
                continue
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            prompt = not _streaming(request)
            if prompt:
                num_new = min(num_new, prefill_budget)
                if num_new == 0:
                    continue
            while not self._grow(request, num_new):
                victim = self.running[-1]
                self._preempt(victim)
                preempted += 1
                if victim is request:
                    break
            if request.status != RequestStatus.RUNNING:
                continue
            chunks.append(self._chunk(request, num_new, new_requests))
            budget -= num_new
            prefill_budget -= num_new if prompt else 0

        deferred = []  # waiting on blocks a running request computes in this step (kept in order)
        while self.waiting and budget > 0 and not preempted:
            request = self.waiting[0]
            if request.transfer == TransferState.AWAITING_KV:
                if not self._admit_remote(request, remote_loads):
                    break
                continue
            if self._num_seqs >= self.config.max_num_seqs or self._kv_arriving(request.after):
                break
            pulled = self._admit_pull(request, remote_pulls) if self._may_pull(request) else None
            if pulled is not None:
                if not pulled:
                    break
                continue
            if self._prefix_computing(request):
                deferred.append(self.waiting.popleft())
                continue
            if prefill_budget == 0 or not self._admit(request, min(budget, prefill_budget)):
                break
            num_new = min(request.num_tokens - request.num_computed_tokens, budget, prefill_budget)
            chunks.append(self._chunk(request, num_new, new_requests))
            budget -= num_new
            prefill_budget -= num_new
        self.waiting.extendleft(reversed(deferred))

        finished, self._finished_ids = self._finished_ids, []
        return SchedulerOutput(chunks, new_requests, finished, preempted, remote_loads, remote_pulls)

    def _prefill_budget(self) -> int:
        """Prompt tokens this step may compute: the step's budget, or while streams run and
        `max_prefill_stall_s` is set, what this instance prefills in that long (at least a block),
        so that a long prompt is prefilled over several steps, each delaying the streams' next token
        about as long (Sarathi-Serve's stall-free batching, its budget from time rather than tokens)."""
        budget = self.config.max_num_batched_tokens
        stall_s = self.config.max_prefill_stall_s
        if stall_s <= 0 or self.prefill_tokens_per_s <= 0 or not any(map(_streaming, self.running)):
            return budget
        return min(budget, max(self.pool.block_size, int(stall_s * self.prefill_tokens_per_s)))

    def advance(self, out: SchedulerOutput) -> None:
        """Record the tokens the ranks just computed."""
        for chunk in out.chunks:
            request = self.requests.get(chunk.request_id)
            if request is None:
                continue
            request.num_computed_tokens = chunk.start_pos + len(chunk.token_ids)
            self.num_prompt_tokens_computed += max(
                0, min(request.num_computed_tokens, request.num_prompt_tokens) - chunk.start_pos)
            self.pool.cache_full_blocks(request)

    # --- helpers --------------------------------------------------------------------------------

    def _kv_arriving(self, request_id: str | None) -> bool:
        """Whether that request's remote KV is still on its way: a sample of the same prompt waits
        for it, then finds the prompt in this instance's prefix cache instead of computing it."""
        other = self.requests.get(request_id) if request_id is not None else None
        return other is not None and (other.status == RequestStatus.WAITING_FOR_REMOTE_KV or (
            other.status == RequestStatus.WAITING and other.transfer == TransferState.AWAITING_KV))

    def _prefix_computing(self, request: Request) -> bool:
        """Whether the first block of its prompt this instance does not cache is one a running request
        is computing: it then waits and finds it cached (siblings that arrive together with a shared
        prefix compute it once)."""
        if not self.pool.enable_prefix_caching or request.prompt_logprobs is not None:
            return False
        bs = self.pool.block_size
        k = len(self.pool.match_prefix(request))
        if k >= (request.num_tokens - 1) // bs:
            return False
        wanted = self.pool.block_hashes(request, k + 1)[k]
        for other in self.running:
            done, full = other.num_computed_tokens // bs, other.num_prompt_tokens // bs
            if done < full and wanted in self.pool.block_hashes(other, full)[done:]:
                return True
        return False

    def _chunk(self, request: Request, num_new: int, new_requests: list[NewRequest]) -> ScheduledChunk:
        start = request.num_computed_tokens
        if not request.sent_to_workers:
            request.sent_to_workers = True
            new_requests.append(NewRequest(request.request_id, _sampling_spec(request)))
        tokens = request.all_token_ids[start:start + num_new]
        targets = []  # the prompt tokens this chunk's rows predict, if its prompt is scored
        if request.prompt_logprobs is not None:
            targets = request.prompt_token_ids[start + 1:min(start + num_new + 1, request.num_prompt_tokens)]
        return ScheduledChunk(
            request_id=request.request_id,
            token_ids=tokens,
            start_pos=start,
            block_ids=list(request.block_ids),
            sample=start + num_new == request.num_tokens,
            prompt_targets=targets,
            num_prompt_logprobs=request.params.prompt_logprobs or 0,
        )

    def _grow(self, request: Request, num_new: int) -> bool:
        """Make the request's blocks cover its computed tokens plus `num_new`."""
        needed = self.pool.blocks_needed(request.num_computed_tokens + num_new) - len(request.block_ids)
        if needed <= 0:
            return True
        if needed > self.pool.num_free_blocks:
            return False
        request.block_ids.extend(self.pool.allocate(needed))
        return True

    def _admit(self, request: Request, budget: int) -> bool:
        # a cached prefix has no logits: a request that scores its prompt computes all of it (vLLM's rule)
        hits = self.pool.match_prefix(request) if request.prompt_logprobs is None else []
        num_cached = len(hits) * self.pool.block_size
        num_new = request.num_tokens - num_cached
        if num_new > budget and not self.config.enable_chunked_prefill:
            return False
        num_new = min(num_new, budget)
        self.pool.take(hits)
        request.block_ids = list(hits)
        request.num_computed_tokens = num_cached
        if not self._grow(request, num_new):
            self.pool.release(request.block_ids)
            request.block_ids = []
            request.num_computed_tokens = 0
            return False
        if request.status == RequestStatus.WAITING and not request.output_token_ids:
            request.num_cached_tokens = num_cached
            if self.pool.enable_prefix_caching and not request.pull_tried:  # a pull counted it
                self.num_prefix_cache_queries += request.num_prompt_tokens
                self.num_prefix_cache_hits += num_cached
        self.waiting.popleft()
        request.move_to(RequestStatus.RUNNING)
        self.running.append(request)
        return True

    def _admit_remote(self, request: Request, remote_loads: list[RemoteLoad]) -> bool:
        """P/D consumer: blocks for the prompt and the producer's first token. The prompt's leading
        full blocks this instance caches, where its hashes agree with the producer's, are shared
        (a full hit READs nothing); the connector reads the rest into new blocks."""
        if self._num_seqs >= self.config.max_num_seqs:
            return False
        hits = self._agreed_hits(request)
        self.pool.take(hits)
        needed = self.pool.blocks_needed(request.num_prompt_tokens + 1) - len(hits)
        if needed > self.pool.num_free_blocks:
            self.pool.release(hits)
            return False
        request.block_ids = hits + self.pool.allocate(needed)
        self._wait_for_kv(request, len(hits))
        remote_loads.append(RemoteLoad(request.request_id, list(request.block_ids), len(hits)))
        return True

    def _wait_for_kv(self, request: Request, num_cached_blocks: int) -> None:
        """Admitted to WAITING_FOR_REMOTE_KV with its blocks, the first `num_cached_blocks` of them
        from this instance's prefix cache (counted as its first lookup)."""
        request.num_cached_tokens = num_cached_blocks * self.pool.block_size
        if self.pool.enable_prefix_caching:
            self.num_prefix_cache_queries += request.num_prompt_tokens
            self.num_prefix_cache_hits += request.num_cached_tokens
        self.waiting.popleft()
        request.move_to(RequestStatus.WAITING_FOR_REMOTE_KV)
        self.loading.append(request)

    def _agreed_hits(self, request: Request) -> list[int]:
        """Cached blocks holding the prompt's leading full blocks, up to the first whose hash differs
        from the producer's (a salt or model key of its own, or params without hashes: none)."""
        theirs = request.kv_transfer.block_hashes
        hits = self.pool.match_prefix(request) if theirs else []  # full prompt blocks, tokens checked
        ours = [wire_hash(h) for h in self.pool.block_hashes(request, len(hits))]
        agreed = next((i for i, (a, b) in enumerate(zip(ours, theirs or ())) if a != b), len(hits))
        return hits[:agreed]

    def _may_pull(self, request: Request) -> bool:
        kv = request.kv_transfer
        return bool(kv is not None and kv.kv_holders and not request.pull_tried and request.prompt_logprobs is None
                    and self.config.kv_pull_min_tokens > 0)

    def _admit_pull(self, request: Request, remote_pulls: list[RemotePull]) -> bool | None:
        """A request whose proxy named holders (instances that may cache a later turn's prompt): a
        producer's, or one a decode instance prefills itself under kv-aware routing. When the
        prompt's full blocks this instance lacks are worth it, allocate them and let the connector
        READ them from a holder instead of computing them (at least one token is left to compute,
        for the first token). None: not worth it, admit as usual."""
        hits = self.pool.match_prefix(request)
        bs = self.pool.block_size
        num_full = (request.num_tokens - 1) // bs
        gap = num_full - len(hits)
        if gap * bs < self.config.kv_pull_min_tokens:
            return None
        self.pool.take(hits)
        if gap > self.pool.num_free_blocks:
            self.pool.release(hits)
            return False
        request.pull_tried = True
        new = self.pool.allocate(gap)
        request.block_ids = hits + new
        request.num_computed_tokens = len(hits) * bs
        self._wait_for_kv(request, len(hits))
        hashes = self.pool.block_hashes(request, num_full)[len(hits):]
        remote_pulls.append(RemotePull(request.request_id, list(new), hashes, request.kv_transfer.kv_holders))
        return True

    # --- the end of a remote load (the engine applies the connector's outcome here) -----------------

    def load_ended(self, request: Request, state: TransferState, num_blocks: int = 0) -> None:
        """A remote load ended in KV_LOADED or RECOMPUTING (FAILED and ABORTED end the request). A
        consumer runs from its first generated token, or prefills its prompt here; a pull (by a
        producer, or by a request served here from start to end) goes on computing after the
        `num_blocks` it read, or computes them all."""
        assert state in (TransferState.KV_LOADED, TransferState.RECOMPUTING), state
        pull = request.transfer in (TransferState.PRODUCING, TransferState.NONE)  # it stays what it was
        if not pull:
            request.move_transfer_to(state)
        if state == TransferState.RECOMPUTING:
            self._prefill_here(request)
        elif pull:  # what it read was found in another instance's cache: a hit too, and not computed
            read = num_blocks * self.pool.block_size
            request.num_cached_tokens += read  # (usage's cached_tokens)
            self.num_prefix_cache_hits += read * self.pool.enable_prefix_caching
            self._run_from(request, request.num_computed_tokens + read)
        else:
            self._run_from(request, request.num_prompt_tokens)

    def _run_from(self, request: Request, num_computed_tokens: int) -> None:
        self.loading.remove(request)
        request.num_computed_tokens = num_computed_tokens
        self.pool.cache_full_blocks(request)
        request.move_to(RequestStatus.RUNNING)
        self.running.append(request)

    def _prefill_here(self, request: Request) -> None:
        """Drop the (possibly partial) KV and prefill from the start, first in line (a request still
        queued just stops waiting for remote KV)."""
        if request.status != RequestStatus.WAITING_FOR_REMOTE_KV:
            return
        self.loading.remove(request)
        self.pool.release(request.block_ids)
        request.block_ids = []
        request.num_computed_tokens = 0
        request.move_to(RequestStatus.WAITING)
        self.waiting.appendleft(request)

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.pool.release(request.block_ids)
        request.block_ids = []
        request.num_registered_blocks = 0  # its recomputed blocks may enter the cache again
        request.num_computed_tokens = 0
        request.move_to(RequestStatus.PREEMPTED)
        self.waiting.appendleft(request)
        self.num_preemptions += 1


def _sampling_spec(request: Request) -> SamplingSpec:
    p = request.params
    presampled = 1 if request.kv_transfer is not None and request.kv_transfer.do_remote_prefill else 0
    controls = request.logits_controls
    if controls is not None:
        controls = with_history(controls, request.prompt_token_ids, request.output_token_ids)
    return SamplingSpec(
        temperature=p.temperature,
        top_p=p.top_p,
        top_k=p.top_k if p.top_k > 0 else 0,
        seed=p.seed,
        num_logprobs=p.logprobs,
        num_presampled=presampled,
        min_p=p.min_p,
        controls=controls,
        grammar=_grammar_spec(request),
    )


def _grammar_spec(request: Request) -> GrammarSpec | None:
    """The request's grammar, resumed after the tokens it already has (a P/D consumer's first)."""
    s = request.params.structured
    return None if s is None else GrammarSpec(s.kind, s.value, list(request.output_token_ids))


def _streaming(request: Request) -> bool:
    """Past its prompt: each step computes its next token (a stream a client is reading)."""
    return bool(request.output_token_ids) and request.num_computed_tokens >= request.num_prompt_tokens
