"""Attention over the paged KV cache (HND layout: [num_blocks, kv_heads, block_size, head_dim]).

Runs in every TP rank, once per layer per step. The step's metadata (which slots to write, which
blocks each sequence reads, the masks) is built once per step by the model runner and shared by all
layers; this module only does the math.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools

import torch
import torch.nn.functional as F

from pdserve.model import kernels
from pdserve.model.kv_dtype import dequantize


@dataclasses.dataclass
class PrefillSeq:
    """One sequence computing several tokens this step (a prompt, a chunk of one, or a recompute)."""

    start: int  # first row of this sequence in the step's flat token batch
    num_tokens: int
    context_len: int  # tokens in the cache once this step's tokens are written
    block_ids: torch.Tensor  # [blocks covering context_len]
    mask: torch.Tensor | None  # [num_tokens, context_len] bool, None = plain causal over fresh tokens


@dataclasses.dataclass
class AttentionMetadata:
    slot_blocks: torch.Tensor  # [tokens] block id where each token's K/V goes
    slot_offsets: torch.Tensor  # [tokens] offset inside that block
    prefills: list[PrefillSeq]
    decode_start: int  # rows [decode_start, tokens) are single-token decodes
    decode_block_tables: torch.Tensor | None  # [decodes, max_blocks], padded with block 0
    decode_context_lens: torch.Tensor | None = None  # [decodes] int32
    sliding_window: int | None = None


def build_mask(positions: torch.Tensor, context_len: int, sliding_window: int | None) -> torch.Tensor:
    """[queries, context_len] bool: query at absolute position p sees keys j <= p (and p - j < window)."""
    keys = torch.arange(context_len)
    mask = keys[None, :] <= positions[:, None]
    if sliding_window is not None:
        mask &= keys[None, :] > positions[:, None] - sliding_window
    return mask


def paged_attention(
    q: torch.Tensor,  # [tokens, heads, head_dim]
    k: torch.Tensor,  # [tokens, kv_heads, head_dim]
    v: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, kv_heads, block_size, head_dim]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,  # fp8: [num_blocks, kv_heads, block_size] each
) -> torch.Tensor:
    """Attend, with this step's K/V already written to the cache (fused.rope_write_kv). The cache
    may store another dtype than q's (model/kv_dtype.py): what is read from it is converted to q's.
    Returns [tokens, heads, head_dim]."""
    k_scale, v_scale = scales or (None, None)
    out = torch.empty_like(q)
    for seq in meta.prefills:
        rows = slice(seq.start, seq.start + seq.num_tokens)
        qs = q[rows].transpose(0, 1).unsqueeze(0)  # [1, heads, tokens, head_dim]
        if seq.mask is None:  # the whole context is this step's tokens
            ks = k[rows].transpose(0, 1).unsqueeze(0)
            vs = v[rows].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
        else:
            ks = _read(k_cache, k_scale, seq.block_ids, q.dtype)[None, :, : seq.context_len]
            vs = _read(v_cache, v_scale, seq.block_ids, q.dtype)[None, :, : seq.context_len]
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=seq.mask, enable_gqa=True)
        out[rows] = o[0].transpose(0, 1)
    if meta.decode_block_tables is not None:
        rows = slice(meta.decode_start, q.shape[0])
        native = None
        if q.dtype == torch.float32 and k_cache.dtype in _NATIVE_KV and q.device.type == "cpu":
            native = native_decode(k_cache.dtype)
        if native is not None:
            out[rows] = native(q[rows], k_cache, v_cache, meta.decode_block_tables,
                               meta.decode_context_lens, meta.sliding_window, scales)
        else:
            tables = meta.decode_block_tables
            mask = build_mask(meta.decode_context_lens.long() - 1, tables.shape[1] * k_cache.shape[2],
                              meta.sliding_window)
            out[rows] = _decode_attention(q[rows], k_cache, v_cache, tables, mask[:, None, None, :], scales)
    return out


_NATIVE_KV = {torch.float32: "paged_decode_attention", torch.bfloat16: "paged_decode_attention_bf16",
              torch.float8_e4m3fn: "paged_decode_attention_fp8"}
_SCALED_KV = (torch.float8_e4m3fn,)  # the kernel takes the per-slot scales too


class NativeDecode:
    """The C kernel (kernels/paged_attention.c): reads K and V in place, as stored (float32,
    bfloat16, or fp8 with its per-slot scales), one (sequence, KV head) per work item, on this
    rank's torch threads."""

    def __init__(self, lib, name: str = "paged_decode_attention", scaled: bool = False):
        fn = getattr(lib, name)
        p, i = ctypes.c_void_p, ctypes.c_int
        fn.argtypes = [p, p, p, *([p, p] if scaled else []), p, p, p, i, i, i, i, i, i, i, ctypes.c_float, i]
        fn.restype = None
        self.fn = fn
        self.scaled = scaled

    def __call__(self, q, k_cache, v_cache, tables, context_lens, window,
                 scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        q = q.contiguous()
        seqs, num_heads, head_dim = q.shape
        _, kv_heads, block_size, _ = k_cache.shape
        out = torch.empty_like(q)
        scale_ptrs = []
        if self.scaled:
            if scales is None or not all(s.is_contiguous() and s.dtype == torch.float32 for s in scales):
                raise ValueError("an fp8 cache is read with its contiguous float32 scales")
            scale_ptrs = [scales[0].data_ptr(), scales[1].data_ptr()]
        self.fn(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), *scale_ptrs, tables.data_ptr(),
                context_lens.data_ptr(), out.data_ptr(), seqs, num_heads, kv_heads, head_dim,
                block_size, tables.shape[1], window or 0, head_dim ** -0.5, torch.get_num_threads())
        return out


@functools.lru_cache(maxsize=None)
def native_decode(kv_dtype: torch.dtype = torch.float32, march: str | None = None) -> NativeDecode | None:
    """The kernel for this KV dtype, built for this CPU (`march`: another's build, for tests)."""
    lib = kernels.load("paged_attention", march=march)
    if lib is None or not hasattr(lib, _NATIVE_KV[kv_dtype]):  # fp8 needs a compiler with _Float16
        return None
    return NativeDecode(lib, _NATIVE_KV[kv_dtype], kv_dtype in _SCALED_KV)


def _decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      tables: torch.Tensor, mask: torch.Tensor,
                      scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """One query per sequence. The gathered blocks stay in cache order ([blocks, kv_heads, slot]);
    one batched matmul scores every query head against every gathered row (the cross-head products
    are cheap next to a transposing copy of K and V), and the matching heads are picked out by a
    diagonal view. q: [seqs, heads, head_dim] -> [seqs, heads, head_dim]."""
    seqs, num_heads, head_dim = q.shape
    _, kv_heads, block_size, _ = k_cache.shape
    group = num_heads // kv_heads
    nb = tables.shape[1]
    flat = tables.reshape(-1)
    k_scale, v_scale = scales or (None, None)
    k = _select(k_cache, k_scale, flat, q.dtype).view(seqs, nb * kv_heads * block_size, head_dim)
    v = _select(v_cache, v_scale, flat, q.dtype).view(seqs, nb * kv_heads * block_size, head_dim)
    scores = torch.bmm(k, q.transpose(1, 2) * head_dim ** -0.5)  # [seqs, rows, heads]
    scores = scores.view(seqs, nb, kv_heads, block_size, kv_heads, group)
    scores = scores.diagonal(dim1=2, dim2=4)  # [seqs, nb, block_size, group, kv_heads]
    scores = scores.permute(0, 4, 3, 1, 2).reshape(seqs, kv_heads, group, nb * block_size)
    scores = scores.float().masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(q.dtype).view(seqs, kv_heads, group, nb, block_size)
    spread = torch.zeros(seqs, kv_heads, group, nb, kv_heads, block_size, dtype=q.dtype)
    spread.diagonal(dim1=1, dim2=4).copy_(probs.permute(0, 2, 3, 4, 1))
    return torch.bmm(spread.view(seqs, num_heads, -1), v)  # heads ordered (kv head, group)


def _gather(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """Blocks -> keys in order, without a second copy: block_ids [blocks] gives
    [kv_heads, blocks * block_size, head_dim]; block_ids [seqs, blocks] gives a strided view
    [seqs, kv_heads, blocks * block_size, head_dim]."""
    heads, block_size, head_dim = cache.shape[1:]
    gathered = cache.transpose(0, 1)[:, block_ids]  # [kv_heads, (seqs,) blocks, block_size, head_dim]
    if block_ids.dim() == 1:
        return gathered.view(heads, -1, head_dim)
    return gathered.view(heads, block_ids.shape[0], -1, head_dim).transpose(0, 1)


def _select(cache: torch.Tensor, scale: torch.Tensor | None, flat: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The blocks `flat` of a cache, in `dtype`: [len(flat), kv_heads, block_size, head_dim]."""
    return dequantize(torch.index_select(cache, 0, flat),
                      None if scale is None else torch.index_select(scale, 0, flat), dtype)


def _read(cache: torch.Tensor, scale: torch.Tensor | None, block_ids: torch.Tensor,
          dtype: torch.dtype) -> torch.Tensor:
    """`_gather`, in `dtype`."""
    return dequantize(_gather(cache, block_ids),
                      None if scale is None else _gather(scale.unsqueeze(-1), block_ids)[..., 0], dtype)
