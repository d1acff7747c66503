"""The KV block pool of one instance: reference counts, LRU reuse and automatic prefix caching.

Engine process (the TP ranks only see block ids). A block is owned by the requests that reference it
(ref_count); a free block keeps its prefix-cache hash until it is reused, so a repeated prefix finds it.
Full blocks are identified by a hash chain over their token ids. Quarantined blocks (an expired P/D
lease) are neither free nor owned until their release time passes.
"""

from __future__ import annotations

from collections import OrderedDict

from pdserve.engine.request import Request


class NoFreeBlocksError(RuntimeError):
    pass


def _chain_hash(parent: int | None, tokens: tuple[int, ...]) -> int:
    return hash((parent, tokens))


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.block_tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[int, int] = {}  # hash -> block id
        self.quarantine: list[tuple[float, list[int]]] = []  # (release time, blocks)

    # --- counts -------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def num_quarantined_blocks(self) -> int:
        return sum(len(b) for _, b in self.quarantine)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # --- prefix cache -------------------------------------------------------------------------

    def match_prefix(self, request: Request) -> list[int]:
        """Cached blocks holding the longest full-block prefix of the request (no ownership taken).
        At least one token is always left to compute, so a fully cached prompt drops its last block."""
        if not self.enable_prefix_caching:
            return []
        tokens = request.all_token_ids
        num_full = (len(tokens) - 1) // self.block_size
        hits, parent = [], None
        for i in range(num_full):
            chunk = tuple(tokens[i * self.block_size:(i + 1) * self.block_size])
            h = _chain_hash(parent, chunk)
            block = self.cached.get(h)
            if block is None or self.block_tokens[block] != chunk:
                break
            hits.append(block)
            parent = h
        return hits

    def cache_full_blocks(self, request: Request) -> None:
        """Register the request's blocks that are now full of computed tokens."""
        if not self.enable_prefix_caching:
            return
        num_full = request.num_computed_tokens // self.block_size
        tokens = request.all_token_ids
        while len(request.block_hashes) < num_full:
            i = len(request.block_hashes)
            parent = request.block_hashes[-1] if i else None
            chunk = tuple(tokens[i * self.block_size:(i + 1) * self.block_size])
            h = _chain_hash(parent, chunk)
            request.block_hashes.append(h)
            block = request.block_ids[i]
            if self.block_hash[block] is None and h not in self.cached:
                self.block_hash[block] = h
                self.block_tokens[block] = chunk
                self.cached[h] = block

    # --- ownership ----------------------------------------------------------------------------

    def take(self, block_ids: list[int]) -> None:
        """Add one owner to each block (prefix-cache hits); a free block leaves the free list."""
        for b in block_ids:
            if self.ref_counts[b] == 0:
                del self.free[b]
            self.ref_counts[b] += 1

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free):
            raise NoFreeBlocksError(f"need {n} blocks, {len(self.free)} free")
        blocks = []
        for _ in range(n):
            b, _ = self.free.popitem(last=False)
            self._evict(b)
            self.ref_counts[b] = 1
            blocks.append(b)
        return blocks

    def release(self, block_ids: list[int]) -> None:
        """Drop one owner of each block; blocks are released tail first, so the prefix stays cached
        longest (the free list is LRU)."""
        for b in reversed(block_ids):
            assert self.ref_counts[b] > 0, f"block {b} released twice"
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self.free[b] = None

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

    def _evict(self, b: int) -> None:
        h = self.block_hash[b]
        if h is not None:
            if self.cached.get(h) == b:
                del self.cached[h]
            self.block_hash[b] = None
            self.block_tokens[b] = None

    def reset_prefix_cache(self) -> None:
        for b in list(self.free):
            self._evict(b)
