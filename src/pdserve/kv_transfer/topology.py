"""Which producer rank each consumer rank reads which KV heads from, as one pure function.

Used by the consumer (what to read, whom to handshake with) and by the producer (which reads to
expect before freeing a request's blocks), so both sides agree by construction. Thinks in global KV
heads (docs/design.md, "The TP plan"): a consumer head is read from exactly one producer rank that
holds it, the replica chosen by consumer rank when the producer replicates heads.
"""

from __future__ import annotations

import dataclasses
import functools

from pdserve.model.parallel import kv_head_range


@dataclasses.dataclass(frozen=True)
class HeadSlice:
    """Consumer rank reads `num_heads` consecutive heads from one producer rank."""

    consumer_rank: int
    producer_rank: int
    first_head: int  # global KV head
    num_heads: int
    producer_offset: int  # index of first_head among the producer rank's local heads
    consumer_offset: int  # ... among the consumer rank's local heads


@functools.lru_cache(maxsize=256)
def read_plan(producer_tp_size: int, consumer_tp_size: int,
              num_kv_heads: int) -> tuple[tuple[HeadSlice, ...], ...]:
    """Per consumer rank, the slices it reads (consecutive heads from one producer rank merged)."""
    for tp in (producer_tp_size, consumer_tp_size):
        if tp < 1 or (num_kv_heads % tp and tp % num_kv_heads):
            raise ValueError(f"tp_size={tp} cannot shard {num_kv_heads} KV heads")
    plan = []
    for c in range(consumer_tp_size):
        mine = kv_head_range(c, consumer_tp_size, num_kv_heads)
        slices: list[HeadSlice] = []
        for h in mine:
            holders = [p for p in range(producer_tp_size)
                       if h in kv_head_range(p, producer_tp_size, num_kv_heads)]
            p = holders[c % len(holders)]
            p_offset = h - kv_head_range(p, producer_tp_size, num_kv_heads).start
            c_offset = h - mine.start
            last = slices[-1] if slices else None
            if last and last.producer_rank == p and last.first_head + last.num_heads == h \
                    and last.producer_offset + last.num_heads == p_offset:
                slices[-1] = dataclasses.replace(last, num_heads=last.num_heads + 1)
            else:
                slices.append(HeadSlice(c, p, h, 1, p_offset, c_offset))
        plan.append(tuple(slices))
    return tuple(plan)


def producer_ranks_for(consumer_rank: int, producer_tp_size: int, consumer_tp_size: int,
                       num_kv_heads: int) -> list[int]:
    """The producer ranks one consumer rank handshakes with and reads from."""
    plan = read_plan(producer_tp_size, consumer_tp_size, num_kv_heads)
    return sorted({s.producer_rank for s in plan[consumer_rank]})


def expected_reads(producer_tp_size: int, consumer_tp_size: int,
                   num_kv_heads: int) -> frozenset[tuple[int, int]]:
    """Every (consumer rank, producer rank) pair that must report its read before blocks are freed."""
    plan = read_plan(producer_tp_size, consumer_tp_size, num_kv_heads)
    return frozenset((s.consumer_rank, s.producer_rank) for slices in plan for s in slices)
