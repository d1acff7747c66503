"""Decode attention: the C kernel and the PyTorch fallback agree with a naive reference."""

from __future__ import annotations

import pytest
import torch
from helpers import MARCHES

from pdserve.model.attention import _decode_attention, build_mask, native_decode


def naive(q, k_cache, v_cache, tables, lens, window):
    seqs, heads, d = q.shape
    _, kv_heads, bs, _ = k_cache.shape
    out = torch.empty_like(q)
    for b in range(seqs):
        n = int(lens[b])
        k = torch.cat([k_cache[t] for t in tables[b]], dim=1)[:, :n]  # [kv_heads, n, d]
        v = torch.cat([v_cache[t] for t in tables[b]], dim=1)[:, :n]
        first = max(0, n - window) if window else 0
        for h in range(heads):
            kh = h // (heads // kv_heads)
            s = (k[kh, first:] @ q[b, h].double()) / d ** 0.5
            out[b, h] = (torch.softmax(s, 0) @ v[kh, first:].double()).float()
    return out


@pytest.mark.parametrize("march", MARCHES)
@pytest.mark.parametrize("window", [None, 5, 20])
@pytest.mark.parametrize("kv_heads, heads", [(2, 4), (1, 4), (4, 4), (3, 9), (1, 6)])
@pytest.mark.parametrize("bs, d", [(4, 32), (16, 64), (16, 128), (8, 40)])
def test_kernel_and_fallback_match_reference(kv_heads, heads, window, bs, d, march):
    """Head sizes 32/64/128 take the kernel's vector path (64 and 128 specialised), 40 its plain
    loop (the AVX2 path's odd chunk count); contexts cross blocks and 8- and 16-token groups, start
    mid-block under a window and end on and off block edges; 1 to 6 query heads per KV head (the
    AVX2 path's passes of up to 4)."""
    g = torch.Generator().manual_seed(0)
    blocks = 80
    k_cache = torch.randn(blocks, kv_heads, bs, d, generator=g).double()
    v_cache = torch.randn(blocks, kv_heads, bs, d, generator=g).double()
    lens = torch.tensor([1, 7, 13, 16, 17, 33, 50], dtype=torch.int32)
    per_seq = -(-int(lens.max()) // bs)
    tables = torch.stack([torch.randperm(blocks, generator=g)[:per_seq] for _ in lens])
    q = torch.randn(len(lens), heads, d, generator=g)
    expected = naive(q, k_cache, v_cache, tables, lens, window)
    kc, vc = k_cache.float(), v_cache.float()
    mask = build_mask(lens.long() - 1, tables.shape[1] * bs, window)[:, None, None, :]
    fallback = _decode_attention(q, kc, vc, tables, mask)
    assert torch.allclose(fallback, expected, atol=1e-5)
    kernel = native_decode(torch.float32, march)
    assert kernel is not None, "the C kernel should build here (gcc is present)"
    assert torch.allclose(kernel(q, kc, vc, tables, lens, window), expected, atol=1e-5)


@pytest.mark.parametrize("march", MARCHES)
@pytest.mark.parametrize("d", [64, 40])
def test_bfloat16_cache_kernel_reads_the_stored_values(d, march):
    """A bfloat16 cache is read in place, widened exactly: the answer is the reference's over the
    cache's own (rounded) values, on the vector path and the plain loop."""
    g = torch.Generator().manual_seed(1)
    blocks, bs = 40, 16
    k_cache = torch.randn(blocks, 2, bs, d, generator=g).to(torch.bfloat16)
    v_cache = torch.randn(blocks, 2, bs, d, generator=g).to(torch.bfloat16)
    lens = torch.tensor([1, 17, 90, 200], dtype=torch.int32)
    tables = torch.stack([torch.randperm(blocks, generator=g)[:13] for _ in lens])
    q = torch.randn(len(lens), 4, d, generator=g)
    expected = naive(q, k_cache.double(), v_cache.double(), tables, lens, None)
    kernel = native_decode(torch.bfloat16, march)
    assert kernel is not None
    assert torch.allclose(kernel(q, k_cache, v_cache, tables, lens, None), expected, atol=1e-5)


@pytest.mark.parametrize("march", MARCHES)
@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize("d", [64, 128, 40])
def test_fp8_cache_kernel_reads_codes_times_scales(d, window, march):
    """An fp8 cache is read in place: each row's codes (subnormals and both signs included) times
    its slot's scale, exactly the values kv_dtype.dequantize gives, on the vector paths and the
    plain loop."""
    from pdserve.model.kv_dtype import dequantize, quantize

    g = torch.Generator().manual_seed(2)
    blocks, bs, kv_heads = 40, 16, 2
    raw_k = torch.randn(blocks, kv_heads, bs, d, generator=g) * torch.rand(blocks, kv_heads, bs, 1, generator=g) * 5
    raw_v = torch.randn(blocks, kv_heads, bs, d, generator=g)
    raw_k[..., :3] = torch.tensor([1e-6, -1e-6, 0.0])  # below e4m3's normal range at the row's scale
    (k_cache, k_scale), (v_cache, v_scale) = quantize(raw_k), quantize(raw_v)
    assert (k_cache.view(torch.uint8) & 0x78 == 0).logical_and(k_cache.view(torch.uint8) & 7 != 0).any()
    lens = torch.tensor([1, 17, 90, 200], dtype=torch.int32)
    tables = torch.stack([torch.randperm(blocks, generator=g)[:13] for _ in lens])
    q = torch.randn(len(lens), 4, d, generator=g)
    expected = naive(q, dequantize(k_cache, k_scale, torch.float64), dequantize(v_cache, v_scale, torch.float64),
                     tables, lens, window)
    kernel = native_decode(torch.float8_e4m3fn, march)
    assert kernel is not None
    got = kernel(q, k_cache, v_cache, tables, lens, window, (k_scale, v_scale))
    assert torch.allclose(got, expected, atol=1e-5)
