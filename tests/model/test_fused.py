"""The fused C ops (kernels/decoder_ops.c) against the PyTorch ops they replace."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import MARCHES

from pdserve.model import fused, kernels
from pdserve.model.kv_dtype import write_kv
from pdserve.model.layers import RotaryEmbedding, rms_norm


@pytest.fixture(autouse=True, params=MARCHES)
def native_ops(request, monkeypatch):
    """Every test on the ops as built for this CPU and as built for AVX2 (decoder_ops.c's 8-lane paths)."""
    monkeypatch.setattr(kernels, "MARCH", request.param)
    assert fused._native(torch.empty(0)) is not None, "the C ops should build here (gcc is present)"


def _rand(*shape, seed=0, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


@pytest.mark.parametrize("rows, cols", [(1, 64), (32, 512), (3, 100), (300, 512)])  # 300x512: threaded
@pytest.mark.parametrize("with_delta", [False, True])
def test_add_rms_norm(rows, cols, with_delta):
    x, delta, w = _rand(rows, cols, seed=1), _rand(rows, cols, seed=2), _rand(cols, seed=3)
    expected_x = x + delta if with_delta else x.clone()
    expected = rms_norm(expected_x, w, 1e-5)
    out = fused.add_rms_norm(x, delta if with_delta else None, w, 1e-5)
    assert torch.equal(x, expected_x)  # the residual stream was updated in place
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.float(), b.float()  # exact for every cache dtype
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))


@pytest.mark.parametrize("tokens", [1, 5, 200])  # 200: threaded
@pytest.mark.parametrize("heads, kv_heads, d", [(8, 4, 64), (4, 1, 32), (2, 2, 40)])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_rope_write_kv(tokens, heads, kv_heads, d, cache_dtype):
    """Rotated as layers.py rotates, and stored as kv_dtype.write_kv stores (torch's rounding)."""
    fp8 = cache_dtype is torch.float8_e4m3fn
    rope = RotaryEmbedding(d, 512, 10000.0, None, torch.float32)
    qkv = _rand(tokens, (heads + 2 * kv_heads) * d, seed=4)
    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], -1)  # strided rows, as in the model
    q, k, v = (t.view(tokens, -1, d) for t in (q, k, v))
    positions = torch.randint(0, 512, (tokens,), generator=torch.Generator().manual_seed(5))
    blocks, bs = 64, 16
    slots = torch.randperm(blocks * bs, generator=torch.Generator().manual_seed(6))[:tokens]
    slot_blocks, slot_offsets = slots // bs, slots % bs
    exp_q, exp_k = rope(positions, q, k)
    if fp8:
        v[0, 0] = 0.0  # scale 1
        v[0, -1] = torch.tensor([448.0] + [1.0625, 1.1875, -1.1875, 2.375] * d)[:d]  # scale 1; ties to even
        v[-1, -1] = torch.logspace(-6, 0, d) * torch.tensor([1.0, -1.0]).repeat(d // 2)  # subnormal codes
    else:
        v[0, 0, :3] = torch.tensor([float("nan"), float("inf"), 1.0 + 3 * 2 ** -8])  # a tie rounding up, to even

    def caches():
        kc = torch.zeros(blocks, kv_heads, bs, d, dtype=cache_dtype)
        scales = (torch.zeros(blocks, kv_heads, bs), torch.zeros(blocks, kv_heads, bs)) if fp8 else None
        return kc, torch.zeros_like(kc), scales

    kc, vc, scales = caches()
    out_q, out_k = fused.rope_write_kv(rope, positions, q, k, v, kc, vc, slot_blocks, slot_offsets, scales)
    torch.testing.assert_close(out_q, exp_q, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out_k, exp_k, rtol=1e-5, atol=1e-6)
    want_kc, want_vc, want_scales = caches()  # the rows it rotated, stored by torch
    write_kv(want_kc, want_vc, out_k, v, slot_blocks, slot_offsets, want_scales)
    assert _same_values(kc, want_kc) and _same_values(vc, want_vc)
    if fp8:
        assert torch.equal(kc.view(torch.uint8), want_kc.view(torch.uint8))
        assert torch.equal(vc.view(torch.uint8), want_vc.view(torch.uint8))
        assert torch.equal(scales[0], want_scales[0]) and torch.equal(scales[1], want_scales[1])
        assert (vc[slot_blocks[-1], -1, slot_offsets[-1]].view(torch.uint8) & 0x78 == 0).sum() > 4  # subnormals


@pytest.mark.parametrize("rows, inter", [(1, 16), (32, 1408), (3, 37), (100, 1408)])
def test_silu_mul(rows, inter):
    gate_up = _rand(rows, 2 * inter, seed=7, scale=6.0)
    gate_up[0, :4] = torch.tensor([-100.0, -88.0, 0.0, 100.0])  # the exp's clamps
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(fused.silu_mul(gate_up), F.silu(gate) * up, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("rows, vocab", [(1, 8192), (32, 8192), (4, 1003), (3, 7)])
def test_argmax_logsumexp(rows, vocab):
    logits = _rand(rows, vocab, seed=8, scale=5.0)
    logits[0, 3] = -float("inf")
    logits[0, vocab // 2] = logits[0, vocab - 1] = 40.0  # a tie: the first index wins, as in torch
    tokens, lse = fused.argmax_logsumexp(logits)
    assert torch.equal(tokens, logits.argmax(dim=-1))
    torch.testing.assert_close(lse, torch.logsumexp(logits, dim=-1), rtol=1e-6, atol=1e-5)
