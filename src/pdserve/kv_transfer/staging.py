"""A READ from a producer whose KV cache dtype differs from this rank's: the blocks land in a staging
area in the producer's dtype, then are converted into this rank's cache (model/kv_dtype.py).

Consumer TP rank, the transport thread, once per such READ: allocated and registered with the
rank's main agent when the READ is posted, converted and deregistered when it has landed (or only
deregistered when it failed). Each rank converts exactly the blocks it READ: this rank's heads.
"""

from __future__ import annotations

import ctypes

import torch

from pdserve.kv_transfer.descriptors import RegionTable
from pdserve.model import kv_dtype


def _view(address: int, size_bytes: int, dtype: torch.dtype) -> torch.Tensor:
    """Host memory we own (a registered cache) as a flat tensor, without a copy."""
    return torch.frombuffer((ctypes.c_byte * size_bytes).from_address(address), dtype=torch.uint8).view(dtype)


class Staging:
    def __init__(self, local: RegionTable, remote: RegionTable, num_blocks: int):
        """Room for `num_blocks` blocks of every region, this rank's heads, in `remote`'s dtype."""
        assert local.scales is None and remote.scales is None, "fp8 pairs are never converted"
        self.local, self.num_blocks = local, num_blocks
        block_bytes = local.num_kv_heads * remote.head_bytes
        num_regions = len(local.region_addresses)
        self.memory = torch.empty(num_regions * num_blocks * block_bytes, dtype=torch.uint8)
        base = self.memory.data_ptr()
        self.regions = RegionTable(tuple(base + r * num_blocks * block_bytes for r in range(num_regions)),
                                   block_bytes, remote.head_bytes, local.num_kv_heads, num_blocks, remote.dtype)

    @property
    def address(self) -> int:
        return self.memory.data_ptr()

    @property
    def size_bytes(self) -> int:
        return self.memory.numel()

    def convert_into_cache(self, local_block_ids: list[int]) -> None:
        """Staged block i -> local block local_block_ids[i], in every region, in this rank's dtype."""
        src_dtype, dst_dtype = kv_dtype.torch_dtype(self.regions.dtype), kv_dtype.torch_dtype(self.local.dtype)
        ids = torch.tensor(local_block_ids, dtype=torch.long)
        staged = self.memory.view(src_dtype).view(len(self.regions.region_addresses), self.num_blocks, -1)
        for r, address in enumerate(self.local.region_addresses):
            region = _view(address, self.local.num_blocks * self.local.block_bytes, dst_dtype)
            region.view(self.local.num_blocks, -1)[ids] = staged[r].to(dst_dtype)
