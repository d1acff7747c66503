"""NIXL descriptors for one request's READ from one producer rank, built with numpy (docs/design.md, "The TP plan").

Consumer TP rank, once per (request, producer rank). Each region (layer K, layer V) of each block
contributes the byte range of the heads read; when the slice is the whole block on both sides
(equal head split) runs of consecutive block ids on both sides merge into one descriptor.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from pdserve.kv_transfer.topology import HeadSlice


@dataclasses.dataclass(frozen=True)
class RegionTable:
    """One rank's cache geometry as a peer sees it."""

    region_addresses: tuple[int, ...]
    block_bytes: int
    head_bytes: int
    num_kv_heads: int
    num_blocks: int
    dtype: str = "float32"  # the stored KV dtype's name
    scales: "RegionTable | None" = None  # fp8: the scale regions, read with the data regions


def build_descriptors(local: RegionTable, remote: RegionTable, s: HeadSlice,
                      local_blocks: list[int], remote_blocks: list[int], coalesce: bool = True
                      ) -> tuple[np.ndarray, np.ndarray]:
    """(local, remote) Nx3 uint64 arrays of (address, length, device id) for one head slice."""
    assert len(local_blocks) == len(remote_blocks) and local.head_bytes == remote.head_bytes
    lb = np.asarray(local_blocks, dtype=np.uint64)
    rb = np.asarray(remote_blocks, dtype=np.uint64)
    length = s.num_heads * local.head_bytes
    whole = s.num_heads == local.num_kv_heads == remote.num_kv_heads
    if coalesce and whole:
        # Runs where both sides continue consecutively become one descriptor per region.
        breaks = np.flatnonzero((np.diff(lb.astype(np.int64)) != 1) | (np.diff(rb.astype(np.int64)) != 1)) + 1
        starts = np.concatenate(([0], breaks))
        run_len = np.diff(np.concatenate((starts, [len(lb)]))).astype(np.uint64)
        lb, rb = lb[starts], rb[starts]
        lengths = run_len * np.uint64(length)
    else:
        lengths = np.full(len(lb), length, dtype=np.uint64)
    l_base = np.asarray(local.region_addresses, dtype=np.uint64)[:, None]
    r_base = np.asarray(remote.region_addresses, dtype=np.uint64)[:, None]
    l_addr = l_base + lb[None, :] * np.uint64(local.block_bytes) + np.uint64(s.consumer_offset * local.head_bytes)
    r_addr = r_base + rb[None, :] * np.uint64(remote.block_bytes) + np.uint64(s.producer_offset * remote.head_bytes)
    n = l_addr.size
    lens = np.broadcast_to(lengths[None, :], l_addr.shape).reshape(-1)
    local_descs = np.stack([l_addr.reshape(-1), lens, np.zeros(n, dtype=np.uint64)], axis=1)
    remote_descs = np.stack([r_addr.reshape(-1), lens, np.zeros(n, dtype=np.uint64)], axis=1)
    return local_descs, remote_descs
