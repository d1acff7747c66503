"""This rank's paged KV cache: one allocation, per layer a K and a V region in HND layout.

Runs in every TP rank, allocated once at start. Region `(layer, kv)` is the contiguous tensor
`[num_blocks, kv_heads_on_this_rank, block_size, head_dim]`; its base address and sizes are what the
KV transfer layer registers with NIXL and what a peer's read plan addresses.
"""

from __future__ import annotations

import dataclasses
import hashlib

import torch

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
    def total_bytes(self) -> int:
        return self.num_regions * self.region_bytes


class KVCache:
    def __init__(self, layout: CacheLayout, dtype: torch.dtype, device: str = "cpu"):
        self.layout = layout
        shape = (layout.num_layers, 2, layout.num_blocks, layout.num_kv_heads,
                 layout.block_size, layout.head_dim)
        if device == "cpu":
            self.buffer = huge_page_tensor(shape, dtype)
        else:
            self.buffer = torch.zeros(shape, dtype=dtype, device=device)
        self.layers = [(self.buffer[i, 0], self.buffer[i, 1]) for i in range(layout.num_layers)]

    @property
    def base_address(self) -> int:
        return self.buffer.data_ptr()

    def region_addresses(self) -> list[int]:
        """Base address of each region, in order (layer 0 K, layer 0 V, layer 1 K, …)."""
        return [self.base_address + i * self.layout.region_bytes for i in range(self.layout.num_regions)]

    def checksum(self, block_ids: list[int]) -> str:
        """Digest of the given blocks in every region (tests compare producer and consumer)."""
        data = self.buffer[:, :, block_ids].contiguous()
        return hashlib.sha256(data.view(torch.uint8).numpy().tobytes()).hexdigest()[:16]
