"""The ops between a decoder layer's GEMMs, fused in C (kernels/decoder_ops.c) with the PyTorch
versions of layers.py as the fallback.

Runs in every TP rank, a few calls per layer per step. The C path takes float32 CPU tensors whose
rows are contiguous; anything else (bfloat16, CUDA, odd strides, no compiler) takes PyTorch's path,
which computes the same thing (tests/model/test_fused.py compares the two).
"""

from __future__ import annotations

import ctypes
import functools

import torch
import torch.nn.functional as F

from pdserve.model import kernels
from pdserve.model.kv_dtype import write_kv
from pdserve.model.layers import RotaryEmbedding, rms_norm

_p, _i, _l, _f = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float


@functools.lru_cache(maxsize=None)
def _lib(march: str) -> ctypes.CDLL | None:
    lib = kernels.load("decoder_ops", march=march)
    if lib is None:
        return None
    lib.add_rms_norm.argtypes = [_p, _p, _p, _p, _i, _i, _f, _i]
    lib.rope_write_kv.argtypes = [_p, _l, _p, _l, _p, _l, _p, _p, _p, _p, _p, _p, _p, _i, _p, _p,
                                  _i, _i, _i, _i, _i, _i]
    lib.silu_mul.argtypes = [_p, _p, _i, _i, _i]
    lib.argmax_logsumexp.argtypes = [_p, _i, _i, _p, _p, _i]
    for fn in (lib.add_rms_norm, lib.rope_write_kv, lib.silu_mul, lib.argmax_logsumexp):
        fn.restype = None
    return lib


# The caches rope_write_kv stores to, converting as torch rounds (decoder_ops.c's enum kv_kind).
KV_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float8_e4m3fn: 2}


def _native(*tensors: torch.Tensor) -> ctypes.CDLL | None:
    """The library when every tensor is float32 on CPU, else None."""
    if all(t.dtype is torch.float32 and t.is_cpu for t in tensors):
        return _lib(kernels.MARCH)
    return None


def _heads_packed(x: torch.Tensor) -> bool:
    """[tokens, heads, head_dim] whose rows may be strided but whose heads are back to back."""
    return x.stride(2) == 1 and x.stride(1) == x.shape[2]


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> torch.Tensor:
    """x += delta (in place; the residual stream), then RMSNorm(x). x, delta: [rows, hidden]."""
    lib = _native(x, weight)
    if lib is None or not x.is_contiguous() or (delta is not None and not delta.is_contiguous()):
        if delta is not None:
            x += delta
        return rms_norm(x, weight, eps)
    out = torch.empty_like(x)
    lib.add_rms_norm(x.data_ptr(), None if delta is None else delta.data_ptr(), weight.data_ptr(),
                     out.data_ptr(), x.shape[0], x.shape[1], eps, torch.get_num_threads())
    return out


def rope_write_kv(rope: RotaryEmbedding, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                  v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_blocks: torch.Tensor, slot_offsets: torch.Tensor,
                  scales: tuple[torch.Tensor, torch.Tensor] | None = None):
    """Rotate q [tokens, heads, d] and k [tokens, kv_heads, d] by position and write k and v into
    their cache slots, in the cache's dtype (`scales`: an fp8 cache's, kv_dtype.py). Returns the
    rotated (q, k); the C path rotates in place."""
    lib = _native(q, k, v, rope.cos)
    if (lib is None or k_cache.dtype not in KV_KINDS or v_cache.dtype is not k_cache.dtype
            or not all(_heads_packed(t) for t in (q, k, v)) or not scales_native(k_cache, scales)):
        q, k = rope(positions, q, k)
        write_kv(k_cache, v_cache, k, v, slot_blocks, slot_offsets, scales)
        return q, k
    tokens, num_heads, d = q.shape
    _, kv_heads, block_size, _ = k_cache.shape
    scale_ptrs = (scales[0].data_ptr(), scales[1].data_ptr()) if scales else (None, None)
    lib.rope_write_kv(q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(),
                      v.stride(0), positions.data_ptr(), rope.cos.data_ptr(), rope.sin.data_ptr(),
                      k_cache.data_ptr(), v_cache.data_ptr(), *scale_ptrs, KV_KINDS[k_cache.dtype],
                      slot_blocks.data_ptr(), slot_offsets.data_ptr(), tokens, num_heads, kv_heads, d,
                      block_size, torch.get_num_threads())
    return q, k


def scales_native(k_cache: torch.Tensor, scales: tuple[torch.Tensor, torch.Tensor] | None) -> bool:
    """Whether the C ops can write this cache's scales: contiguous float32 ones for fp8, none otherwise."""
    if k_cache.dtype is not torch.float8_e4m3fn:
        return scales is None
    return scales is not None and all(s.dtype is torch.float32 and s.is_contiguous() for s in scales)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[rows, 2 * inter] (gate | up) -> silu(gate) * up, [rows, inter]."""
    lib = _native(gate_up)
    if lib is None or not gate_up.is_contiguous():
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, inter, dtype=gate_up.dtype)
    lib.silu_mul(gate_up.data_ptr(), out.data_ptr(), rows, inter, torch.get_num_threads())
    return out


def argmax_logsumexp(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[rows, vocab] -> (argmax [rows] int64, logsumexp [rows]): the greedy token and the
    normaliser of log_softmax, without materialising log_softmax."""
    lib = _native(logits)
    if lib is None or not logits.is_contiguous():
        return logits.argmax(dim=-1), torch.logsumexp(logits, dim=-1)
    rows, vocab = logits.shape
    tokens = torch.empty(rows, dtype=torch.int64)
    lse = torch.empty(rows, dtype=logits.dtype)
    lib.argmax_logsumexp(logits.data_ptr(), rows, vocab, tokens.data_ptr(), lse.data_ptr(),
                         torch.get_num_threads())
    return tokens, lse
