"""Tensor-parallel layout: which heads, columns and vocabulary rows a rank owns, and its collectives.

Runs in every TP rank. The head layout here is the one the KV transfer plan (kv_transfer/topology.py)
reasons about, so there is exactly one definition of "rank r holds KV heads …".
"""

from __future__ import annotations

import dataclasses
from datetime import timedelta

import torch
import torch.distributed as dist


def check_tp_size(tp_size: int, num_heads: int, num_kv_heads: int) -> None:
    """Raise ValueError when `tp_size` cannot shard a model with these head counts."""
    if tp_size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {tp_size}")
    if num_heads % tp_size:
        raise ValueError(
            f"tensor_parallel_size={tp_size} must divide num_attention_heads={num_heads}"
        )
    if num_kv_heads % tp_size and tp_size % num_kv_heads:
        raise ValueError(
            f"tensor_parallel_size={tp_size} must divide num_key_value_heads={num_kv_heads} "
            "or be a multiple of it"
        )


def kv_head_range(rank: int, tp_size: int, num_kv_heads: int) -> range:
    """Global KV heads held by `rank`: a contiguous slice when tp <= H, one replicated head when tp > H."""
    if tp_size <= num_kv_heads:
        per_rank = num_kv_heads // tp_size
        return range(rank * per_rank, (rank + 1) * per_rank)
    head = rank * num_kv_heads // tp_size
    return range(head, head + 1)


def shard_range(size: int, rank: int, tp_size: int) -> tuple[int, int]:
    """[start, end) of an even split of `size` (the last shard may be shorter when it does not divide)."""
    per_rank = -(-size // tp_size)
    start = min(rank * per_rank, size)
    return start, min(start + per_rank, size)


@dataclasses.dataclass
class TPGroup:
    """This rank's place in its tensor-parallel group, with the few collectives the model needs."""

    rank: int
    size: int
    group: dist.ProcessGroup | None = None  # None when size == 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            self.group.allreduce([x]).wait()
        return x

    def gather_to_first(self, x: torch.Tensor) -> torch.Tensor | None:
        """Concatenate equally shaped shards along the last dim on rank 0; other ranks get None."""
        if self.size == 1:
            return x
        x = x.contiguous()
        if self.rank == 0:
            parts = [torch.empty_like(x) for _ in range(self.size)]
            self.group.gather([parts], [x], dist.GatherOptions()).wait()
            return torch.cat(parts, dim=-1)
        self.group.gather([], [x], dist.GatherOptions()).wait()
        return None

    def barrier(self) -> None:
        if self.size > 1:
            self.group.allreduce([torch.zeros(1)]).wait()


def make_group(rank: int, size: int, store_host: str, store_port: int, timeout_s: float,
               store: dist.Store | None = None) -> TPGroup:
    """Join the gloo (CPU) group through the TCP store that rank 0 bound. No global process group is
    created, so several engines can live in one process."""
    if size == 1:
        return TPGroup(rank=0, size=1)
    timeout = timedelta(seconds=timeout_s)
    if store is None:
        store = dist.TCPStore(store_host, store_port, size, is_master=False, timeout=timeout)
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=store_host)]
    group = dist.ProcessGroupGloo(dist.PrefixStore("tp", store), rank, size, options)
    return TPGroup(rank=rank, size=size, group=group)
