"""Which of a disaggregated request's two copies of the prompt's KV is kept: the producer's or the
decode instance's (kv-aware routing).

Proxy process (pure). A remote prefill leaves the prompt cached twice, on its producer and on its
decode instance, so the instances together cache half the prompts they could. The proxy names one
copy the spare (`kv_transfer_params.spare_copy`): that instance reuses those blocks before the rest
of its cache (engine/block_pool.py). A conversation keeps its history in one pool turn after turn,
found by the longest earlier prompt this one extends; new conversations alternate between the
pools, so both pools' caches fill with distinct histories (bench/copies_model.py, on
bench/routing.py's conversation trace: a hit rate of 0.634 against 0.573 with both copies kept).
A prefill on decode itself ("local") leaves one copy, on decode, and the history stays there.
"""

from __future__ import annotations

from collections import OrderedDict

PREFILL, DECODE = "prefill", "decode"
MAX_PROMPTS = 1 << 16  # prompts remembered (a hash and a role each), least recently used forgotten


class Copies:
    def __init__(self, max_prompts: int = MAX_PROMPTS):
        self.max_prompts = max_prompts
        self.keeper: OrderedDict[int, str] = OrderedDict()  # a prompt's last full block hash -> its keeper
        self._new = 0  # new conversations so far: they alternate between the pools

    def spare(self, block_hashes: list[int], local: bool) -> str | None:
        """The role whose copy of this prompt is the spare (None: one copy, or no full block to
        remember it by), remembering which pool keeps it."""
        if not block_hashes:
            return None
        keeper = DECODE if local else self._earlier(block_hashes)
        if keeper is None:
            keeper = (PREFILL, DECODE)[self._new % 2]
            self._new += 1
        self.keeper[block_hashes[-1]] = keeper
        self.keeper.move_to_end(block_hashes[-1])
        while len(self.keeper) > self.max_prompts:
            self.keeper.popitem(last=False)
        return None if local else (DECODE if keeper == PREFILL else PREFILL)

    def _earlier(self, block_hashes: list[int]) -> str | None:
        """The keeper of the longest remembered prompt this one extends (a conversation's last turn)."""
        for h in reversed(block_hashes):
            if h in self.keeper:
                self.keeper.move_to_end(h)
                return self.keeper[h]
        return None
