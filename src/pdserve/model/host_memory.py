"""Host memory on 2 MiB transparent huge pages, for the KV cache and for dense weights.

Every TP rank, at start. NIXL/UCX reads a peer's cache with process_vm_readv, which pins every page
it copies: with 2 MiB pages it moved 16 MiB at 8-12 GB/s instead of 4-6 GB/s. A decode step streams
the batch's KV and every weight once; on 4 KiB pages that is a TLB miss every 4 KiB. (Weights that
linear.py packs for MKL live in MKL's own buffers instead.) Where huge pages are unavailable the
advice is a no-op and the memory is ordinary.
"""

from __future__ import annotations

import ctypes
import math

import torch

_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14
_ALIGN = 64  # bytes: a cache line, so every packed tensor starts on one


def huge_page_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed host tensor on 2 MiB-aligned memory advised to use transparent huge pages."""
    elem = torch.empty(0, dtype=dtype).element_size()
    nbytes = math.prod(shape) * elem
    raw = torch.empty(nbytes + _HUGE_PAGE, dtype=torch.uint8)  # fresh, untouched pages
    offset = (-raw.data_ptr()) % _HUGE_PAGE
    try:
        ctypes.CDLL("libc.so.6").madvise(ctypes.c_void_p(raw.data_ptr() + offset),
                                         ctypes.c_size_t(nbytes), _MADV_HUGEPAGE)
    except OSError:
        pass
    tensor = raw[offset:offset + nbytes].view(dtype).view(shape)
    tensor.zero_()
    return tensor


def to_huge_pages(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Contiguous copies of same-dtype CPU tensors, packed into one huge-page allocation."""
    dtype = tensors[0].dtype
    elem = torch.empty(0, dtype=dtype).element_size()
    sizes = [-(-t.numel() * elem // _ALIGN) * _ALIGN // elem for t in tensors]
    arena = huge_page_tensor((sum(sizes),), dtype)
    out, start = [], 0
    for t, size in zip(tensors, sizes):
        view = arena[start:start + t.numel()].view(t.shape)
        view.copy_(t)
        out.append(view)
        start += size
    return out
