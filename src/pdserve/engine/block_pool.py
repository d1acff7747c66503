"""The KV block pool of one instance: reference counts, LRU reuse and automatic prefix caching.

Engine process (the TP ranks only see block ids). A block is owned by the requests that reference it
(ref_count); a free block keeps its prefix-cache entry until it is reused, so a repeated prefix finds
it. Full blocks are identified by content hashes (`prefix_cache.hashing`: parent, tokens, the
instance's model key and the request's `cache_salt`), the same in every process; at most one block
holds a hash, so what the pool reports through `on_events` (stored, removed, cleared) is exactly
the set of hashes it caches. Quarantined blocks (an expired P/D lease) are neither free nor owned
until their release time passes.

Free blocks wait in two LRU lists, reused in this order: `spare` (blocks caching nothing, and spare
copies: KV another instance keeps, as the kv-aware proxy arranges so that P/D does not cache a
prompt twice) and `free` (the cache proper). A block a request wanted kept stays kept while cached,
unless another instance claims it to keep it instead (`pin`: a conversation's history moved).
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from typing import Callable

from pdserve.engine.request import Request
from pdserve.prefix_cache.events import AllBlocksCleared, BlockRemoved, BlockStored, Event
from pdserve.prefix_cache.hashing import ROOT_HASH, event_hash, extra_keys, hash_blocks


class NoFreeBlocksError(RuntimeError):
    pass


@dataclasses.dataclass(slots=True)
class CachedBlock:
    """What the prefix cache knows of one block (enough to check a hit and to describe it)."""

    block_hash: bytes
    parent_hash: bytes | None  # None for a prompt's first block
    token_ids: tuple[int, ...]
    extra_keys: tuple[str, ...]


UNDECIDED, KEPT, SPARE = 0, 1, 2  # a cached block's copy, as the requests that released it said


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 model_key: str = "", on_events: Callable[[list[Event]], None] | None = None):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.model_key = model_key  # hashed into every block: another model's KV never matches
        self.on_events = on_events  # each operation's events, in order (the engine thread)
        self.ref_counts = [0] * num_blocks
        self.entries: list[CachedBlock | None] = [None] * num_blocks
        self.free: OrderedDict[int, None] = OrderedDict()  # cached blocks no request owns, LRU first
        self.spare: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))  # reused first
        self.copy = bytearray(num_blocks)  # UNDECIDED, KEPT or SPARE, until the block is reused
        self.cached: dict[bytes, int] = {}  # hash -> the one block holding it
        self.quarantine: list[tuple[float, list[int]]] = []  # (release time, blocks)

    # --- counts -------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self.free) + len(self.spare)

    @property
    def num_spare_blocks(self) -> int:
        """Free blocks reused first: spare copies and blocks caching nothing."""
        return len(self.spare)

    @property
    def num_quarantined_blocks(self) -> int:
        return sum(len(b) for _, b in self.quarantine)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # --- prefix cache -------------------------------------------------------------------------

    def block_hashes(self, request: Request, num_blocks: int) -> list[bytes]:
        """The request's first `num_blocks` full-block hashes, computed once each (a request that
        waits for admission step after step is not hashed again)."""
        hashes = request.block_hashes
        if len(hashes) < num_blocks:
            bs, done = self.block_size, len(hashes)
            tokens = request.all_token_ids[done * bs:num_blocks * bs]
            hashes += hash_blocks(tokens, bs, self._keys(request), hashes[-1] if hashes else ROOT_HASH)
        return hashes[:num_blocks]

    def match_prefix(self, request: Request) -> list[int]:
        """Cached blocks holding the longest full-block prefix of the request (no ownership taken).
        At least one token is always left to compute, so a fully cached prompt drops its last block.
        A hit is checked against the block's tokens and keys too (a hash is not trusted alone)."""
        if not self.enable_prefix_caching:
            return []
        tokens, bs = request.all_token_ids, self.block_size
        keys = self._keys(request)
        hits = []
        for i, h in enumerate(self.block_hashes(request, (len(tokens) - 1) // bs)):
            block = self.cached.get(h)
            entry = self.entries[block] if block is not None else None
            if entry is None or entry.extra_keys != keys or \
                    entry.token_ids != tuple(tokens[i * bs:(i + 1) * bs]):
                break
            hits.append(block)
        return hits

    def held_run(self, block_hashes: list[bytes]) -> list[int]:
        """The blocks caching the leading run of these content hashes (a claim from another
        instance: the digest covers the tokens, the chain before them and the extra keys)."""
        blocks = []
        for h in block_hashes:
            block = self.cached.get(h) if self.enable_prefix_caching else None
            if block is None:
                break
            blocks.append(block)
        return blocks

    def cache_full_blocks(self, request: Request) -> None:
        """Register the request's blocks that are now full of computed tokens. A hash another block
        already holds is not registered twice (this copy stays private to the request)."""
        num_full = request.num_computed_tokens // self.block_size
        if not self.enable_prefix_caching or num_full <= request.num_registered_blocks:
            return
        hashes = self.block_hashes(request, num_full)
        tokens, bs, keys = request.all_token_ids, self.block_size, self._keys(request)
        runs: list[list[int]] = []  # consecutive registered block indexes: one BlockStored each
        for i in range(request.num_registered_blocks, num_full):
            block, h = request.block_ids[i], hashes[i]
            if self.entries[block] is not None or h in self.cached:
                continue
            self.entries[block] = CachedBlock(h, hashes[i - 1] if i else None,
                                              tuple(tokens[i * bs:(i + 1) * bs]), keys)
            self.cached[h] = block
            if runs and runs[-1][-1] == i - 1:
                runs[-1].append(i)
            else:
                runs.append([i])
        request.num_registered_blocks = num_full
        if runs and self.on_events is not None:
            self.on_events([self._stored([self.entries[request.block_ids[i]] for i in run]) for run in runs])

    def reset_prefix_cache(self) -> int:
        """Forget every cached block, in use or not (owners keep their blocks, uncached); returns
        how many were cached. Reported as AllBlocksCleared."""
        num_cached = len(self.cached)
        for block in self.cached.values():
            self.entries[block] = None
        self.cached.clear()
        if self.on_events is not None:
            self.on_events([AllBlocksCleared()])
        return num_cached

    def cached_blocks(self) -> list[BlockStored]:
        """Every cached block as a one-block BlockStored (a snapshot's contents)."""
        return [self._stored([self.entries[b]]) for b in self.cached.values()]

    def _keys(self, request: Request) -> tuple[str, ...]:
        return extra_keys(self.model_key, request.cache_salt)

    def _stored(self, entries: list[CachedBlock]) -> BlockStored:
        parent = entries[0].parent_hash
        return BlockStored(block_hashes=[event_hash(e.block_hash) for e in entries],
                           parent_block_hash=event_hash(parent) if parent is not None else None,
                           token_ids=[t for e in entries for t in e.token_ids], block_size=self.block_size,
                           extra_keys=[list(e.extra_keys) for e in entries])

    # --- ownership ----------------------------------------------------------------------------

    def take(self, block_ids: list[int]) -> None:
        """Add one owner to each block (prefix-cache hits); a free block leaves the free list."""
        for b in block_ids:
            if self.ref_counts[b] == 0:
                (self.spare if b in self.spare else self.free).pop(b)
            self.ref_counts[b] += 1

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free_blocks:
            raise NoFreeBlocksError(f"need {n} blocks, {self.num_free_blocks} free")
        blocks, removed = [], []
        for _ in range(n):
            b, _ = (self.spare or self.free).popitem(last=False)
            self.copy[b] = UNDECIDED
            entry = self.entries[b]
            if entry is not None:  # the least recently used free block: its cached KV goes
                del self.cached[entry.block_hash]
                self.entries[b] = None
                removed.append(event_hash(entry.block_hash))
            self.ref_counts[b] = 1
            blocks.append(b)
        if removed and self.on_events is not None:
            self.on_events([BlockRemoved(block_hashes=removed)])
        return blocks

    def release(self, block_ids: list[int], spare: bool | None = None) -> None:
        """Drop one owner of each block; blocks are released tail first, so the prefix stays cached
        longest (the free lists are LRU). `spare`: the owner's word on its copy (`mark`); None
        leaves it as it was (a lease, a pin, a preempted request)."""
        if spare is not None:
            self.mark(block_ids, spare)
        for b in reversed(block_ids):
            assert self.ref_counts[b] > 0, f"block {b} released twice"
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                spare_list = self.entries[b] is None or self.copy[b] == SPARE
                (self.spare if spare_list else self.free)[b] = None

    def mark(self, block_ids: list[int], spare: bool) -> None:
        """An owner says whether its blocks are a spare copy (another instance keeps that KV) or to
        be kept; kept wins over spare while the block stays cached."""
        for b in block_ids:
            if not spare:
                self.copy[b] = KEPT
            elif self.copy[b] != KEPT:
                self.copy[b] = SPARE

    def pin(self, block_hashes: list[bytes], spare: bool = False) -> list[int]:
        """Another instance claims blocks this one caches: one reference on each block of the
        leading run of `block_hashes` held here. `spare`: the claimer keeps them now (a history
        moved), so they become a spare copy here whoever kept them, until a request that uses them
        here releases them kept."""
        blocks = self.held_run(block_hashes)
        self.take(blocks)
        if spare:
            for b in blocks:
                self.copy[b] = SPARE
        return blocks

    def quarantine_blocks(self, block_ids: list[int], until: float) -> None:
        """Keep blocks out of reuse until `until` (monotonic): a late READ of an expired lease must
        never see another request's KV. The caller's references move to the quarantine (full blocks
        stay in the prefix cache: their contents never change)."""
        self.quarantine.append((until, list(block_ids)))

    def next_quarantine_release(self, now: float) -> float | None:
        """Seconds until quarantined blocks come back (None: none are quarantined)."""
        return max(0.0, min(q[0] for q in self.quarantine) - now) if self.quarantine else None

    def release_quarantine(self, now: float) -> int:
        due = [q for q in self.quarantine if q[0] <= now]
        if due:
            self.quarantine = [q for q in self.quarantine if q[0] > now]
            for _, blocks in due:
                self.release(blocks)
        return sum(len(b) for _, b in due)
