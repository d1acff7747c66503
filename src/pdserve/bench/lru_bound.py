"""The prefix hit rate one LRU cache would reach on a run's requests: the bound a cluster's routing
is measured against (issue 21).

Benchmark client process (pure code). The cache holds blocks of `block_size` tokens named by chained
hashes, as an engine's prefix cache does. Each prompt, in the order sent, looks up its leading full
blocks (at most (length - 1) // block_size: the last token is always computed), then stores all its
full blocks; an answer whose tokens are known (multi-turn) is stored with its prompt, as decode
caches it. A request's blocks are stored tail first, so its head is the most recent and a full cache
evicts tails before heads (as vLLM frees a request's blocks). Tokens, like vLLM's
prefix_cache_hits / prefix_cache_queries.
"""

from __future__ import annotations

from collections import OrderedDict


class LRUBound:
    def __init__(self, capacity_blocks: int | None, block_size: int = 16):
        """`capacity_blocks` None: a cache that never evicts (the workload's own reuse)."""
        if capacity_blocks is not None and capacity_blocks < 0:
            raise ValueError(f"--lru-bound-blocks must be >= 0, got {capacity_blocks}")
        if block_size < 1:
            raise ValueError(f"--block-size must be >= 1, got {block_size}")
        self.capacity_blocks = capacity_blocks
        self.block_size = block_size
        self.blocks: OrderedDict[int, None] = OrderedDict()  # least recently used first
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0

    def lookup(self, prompt: list[int]) -> int:
        """A prompt arrives: count its cached leading tokens, then cache its full blocks."""
        hashes = self._hashes(prompt)
        hits = 0
        for h in hashes[:(len(prompt) - 1) // self.block_size]:
            if h not in self.blocks:
                break
            hits += 1
        self.num_queried_tokens += len(prompt)
        self.num_hit_tokens += hits * self.block_size
        self._put(hashes)
        return hits * self.block_size

    def store(self, token_ids: list[int]) -> None:
        """Cache the full blocks of a finished request's tokens (prompt and answer but its last token)."""
        self._put(self._hashes(token_ids))

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0

    def _hashes(self, token_ids: list[int]) -> list[int]:
        bs, parent, out = self.block_size, 0, []
        for i in range(len(token_ids) // bs):
            parent = hash((parent, tuple(token_ids[i * bs:(i + 1) * bs])))  # ints hash alike in every process
            out.append(parent)
        return out

    def _put(self, hashes: list[int]) -> None:
        if self.capacity_blocks == 0:
            return
        for h in reversed(hashes):
            self.blocks[h] = None
            self.blocks.move_to_end(h)
        while self.capacity_blocks is not None and len(self.blocks) > self.capacity_blocks:
            self.blocks.popitem(last=False)
