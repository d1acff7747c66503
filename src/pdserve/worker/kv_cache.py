"""This rank's paged KV cache: one allocation, per layer a K and a V region in HND layout.

Runs in every TP rank, allocated once at start. Region `(layer, kv)` is the contiguous tensor
`[num_blocks, kv_heads_on_this_rank, block_size, head_dim]` in the KV cache dtype (model/kv_dtype.py);
an fp8 cache has, after every data region, one scale region per `(layer, kv)`
`[num_blocks, kv_heads, block_size]` float32. The one allocation's base address and the regions' sizes
are what the KV transfer layer registers with NIXL and what a peer's read plan addresses.
"""

from __future__ import annotations

import dataclasses
import hashlib

import torch

from pdserve.kv_transfer.descriptors import RegionTable
from pdserve.kv_transfer.worker_side import RegisteredCache
from pdserve.model import kv_dtype
from pdserve.model.host_memory import huge_page_tensor


@dataclasses.dataclass(frozen=True)
class CacheLayout:
    """Byte geometry of one rank's cache (also sent to peers in the handshake)."""

    num_layers: int
    num_blocks: int
    num_kv_heads: int  # on this rank
    block_size: int
    head_dim: int
    dtype_bytes: int
    kv_cache_dtype: str = "float32"  # the stored dtype's name (model/kv_dtype.py)

    @classmethod
    def for_dtype(cls, num_layers: int, num_blocks: int, num_kv_heads: int, block_size: int,
                  head_dim: int, kv_cache_dtype: str) -> "CacheLayout":
        return cls(num_layers, num_blocks, num_kv_heads, block_size, head_dim,
                   kv_dtype.element_bytes(kv_cache_dtype), kv_cache_dtype)

    @property
    def head_bytes(self) -> int:  # one head of one block: [block_size, head_dim]
        return self.block_size * self.head_dim * self.dtype_bytes

    @property
    def block_bytes(self) -> int:  # one block of one region: [kv_heads, block_size, head_dim]
        return self.num_kv_heads * self.head_bytes

    @property
    def region_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    @property
    def num_regions(self) -> int:  # K and V per layer
        return 2 * self.num_layers

    @property
    def scale_head_bytes(self) -> int:  # one head's scales in one block: [block_size] (fp8 only)
        return self.block_size * kv_dtype.scale_bytes(self.kv_cache_dtype)

    @property
    def scale_block_bytes(self) -> int:
        return self.num_kv_heads * self.scale_head_bytes

    @property
    def total_bytes(self) -> int:  # data regions, then scale regions
        return self.num_regions * self.num_blocks * (self.block_bytes + self.scale_block_bytes)


class KVCache:
    def __init__(self, layout: CacheLayout, dtype: torch.dtype, device: str = "cpu"):
        """`dtype`: the stored dtype (`layout.kv_cache_dtype`'s)."""
        self.layout = layout
        shape = (layout.num_layers, 2, layout.num_blocks, layout.num_kv_heads,
                 layout.block_size, layout.head_dim)
        if device == "cpu":
            self.memory = huge_page_tensor((layout.total_bytes,), torch.uint8)
        else:
            self.memory = torch.zeros(layout.total_bytes, dtype=torch.uint8, device=device)
        data_bytes = layout.num_regions * layout.region_bytes
        self.buffer = self.memory[:data_bytes].view(dtype).view(shape)
        self.scales = None  # [layers, 2, num_blocks, kv_heads, block_size] for fp8
        if layout.scale_block_bytes:
            self.scales = self.memory[data_bytes:].view(kv_dtype.SCALE_DTYPE).view(shape[:-1])
        # per layer (k, v) or, fp8, (k, v, k_scales, v_scales)
        self.layers = [(self.buffer[i, 0], self.buffer[i, 1])
                       + (() if self.scales is None else (self.scales[i, 0], self.scales[i, 1]))
                       for i in range(layout.num_layers)]

    @property
    def base_address(self) -> int:
        return self.buffer.data_ptr()

    def region_addresses(self) -> list[int]:
        """Base address of each region, in order (layer 0 K, layer 0 V, layer 1 K, …)."""
        return [self.base_address + i * self.layout.region_bytes for i in range(self.layout.num_regions)]

    def scale_region_addresses(self) -> list[int]:
        """Base address of each scale region, in the data regions' order (empty unless fp8)."""
        if self.scales is None:
            return []
        base = self.scales.data_ptr()
        return [base + i * self.layout.num_blocks * self.layout.scale_block_bytes
                for i in range(self.layout.num_regions)]

    def registration(self) -> RegisteredCache:
        """The cache as the connector registers it and peers read it: data regions, and an fp8
        cache's scale regions beside them."""
        layout = self.layout
        scales = None
        if layout.scale_block_bytes:
            scales = RegionTable(tuple(self.scale_region_addresses()), layout.scale_block_bytes,
                                 layout.scale_head_bytes, layout.num_kv_heads, layout.num_blocks)
        return RegisteredCache(self.base_address, layout.total_bytes, str(self.buffer.device),
                               RegionTable(tuple(self.region_addresses()), layout.block_bytes,
                                           layout.head_bytes, layout.num_kv_heads, layout.num_blocks,
                                           layout.kv_cache_dtype, scales))

    def checksum(self, block_ids: list[int]) -> str:
        """Digest of the given blocks in every region, scales included (tests compare producer and
        consumer)."""
        digest = hashlib.sha256()
        for t in (self.buffer, self.scales):
            if t is not None:
                digest.update(t[:, :, block_ids].contiguous().view(torch.uint8).numpy().tobytes())
        return digest.hexdigest()[:16]
