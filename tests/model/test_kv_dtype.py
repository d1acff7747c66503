"""KV cache dtypes: the fp8 codec with its scales, the names vLLM users type, which pairs convert,
and the tiny model's logits with each KV dtype against a float32 cache."""

from __future__ import annotations

import pytest
import torch

from pdserve.model import kv_dtype
from pdserve.model.loader import load_model
from pdserve.model.parallel import TPGroup
from pdserve.model.spec import ModelSpec
from pdserve.worker.kv_cache import CacheLayout, KVCache
from pdserve.worker.messages import ScheduledChunk
from pdserve.worker.model_runner import ModelRunner


def test_fp8_round_trip_is_within_e4m3_precision_of_each_rows_maximum():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, 32, generator=g) * torch.logspace(-3, 3, 64)[:, None, None]
    x[0, 0] = 0.0  # a row of zeros
    codes, scales = kv_dtype.quantize(x)
    assert codes.dtype == torch.float8_e4m3fn and codes.shape == x.shape
    assert scales.dtype == torch.float32 and scales.shape == x.shape[:-1]
    back = kv_dtype.dequantize(codes, scales, torch.float32)
    amax = x.abs().amax(-1, keepdim=True)
    assert ((back - x).abs() <= amax / 16 + 1e-12).all()  # 3 mantissa bits: half an ulp of 2^-3
    assert (back[0, 0] == 0).all() and scales[0, 0] == 1.0
    assert codes.float().abs().amax() == kv_dtype.FP8_MAX  # each row's maximum uses the full range


def test_write_kv_stores_in_the_caches_dtype_and_fp8_scales_per_slot():
    k = torch.randn(3, 2, 8)
    v = torch.randn(3, 2, 8)
    blocks, offsets = torch.tensor([1, 1, 2]), torch.tensor([0, 3, 1])
    kc = torch.zeros(4, 2, 4, 8, dtype=torch.bfloat16)
    vc = torch.zeros_like(kc)
    kv_dtype.write_kv(kc, vc, k, v, blocks, offsets, None)
    assert torch.equal(kc[1, :, 3], k[1].to(torch.bfloat16)) and torch.equal(vc[2, :, 1], v[2].to(torch.bfloat16))
    kc8 = torch.zeros(4, 2, 4, 8, dtype=torch.float8_e4m3fn)
    vc8 = torch.zeros_like(kc8)
    ks, vs = torch.zeros(4, 2, 4), torch.zeros(4, 2, 4)
    kv_dtype.write_kv(kc8, vc8, k, v, blocks, offsets, (ks, vs))
    got = kv_dtype.dequantize(kc8[blocks, :, offsets], ks[blocks, :, offsets], torch.float32)
    assert torch.allclose(got, k, atol=k.abs().amax() / 16)
    assert ks[0].eq(0).all() and ks[1, :, 3].gt(0).all()  # only written slots have scales


def test_names_in_vllms_spelling_and_auto_is_the_model_dtype():
    assert kv_dtype.resolve("auto", torch.bfloat16) == "bfloat16"
    assert kv_dtype.resolve("fp8", torch.float32) == "fp8_e4m3"
    with pytest.raises(kv_dtype.KVDtypeError, match="fp8_e4m3.*got 'int8'"):
        kv_dtype.resolve("int8", torch.float32)


def test_float_dtypes_convert_into_one_another_and_fp8_pairs_only_with_itself():
    floats = ("float32", "bfloat16", "float16")
    assert all(kv_dtype.convertible(a, b) for a in floats for b in floats)
    assert kv_dtype.convertible("fp8_e4m3", "fp8_e4m3")
    assert not kv_dtype.convertible("fp8_e4m3", "float32") and not kv_dtype.convertible("bfloat16", "fp8_e4m3")
    message = kv_dtype.incompatible("fp8_e4m3", "bfloat16")
    assert "fp8_e4m3" in message and "bfloat16" in message


def _logits(model_dir: str, name: str, prompt: list[int], num_decodes: int) -> torch.Tensor:
    """Logits of a chunked prefill (the second chunk reads the first from the cache) and greedy
    decodes after it, with the cache in `name`."""
    spec = ModelSpec.from_dir(model_dir)
    model = load_model(model_dir, spec, TPGroup(0, 1), torch.float32, None)
    layout = CacheLayout.for_dtype(spec.num_layers, 8, spec.num_kv_heads, 16, spec.head_dim, name)
    runner = ModelRunner(model, KVCache(layout, kv_dtype.torch_dtype(name)))
    blocks = list(range(8))
    runner.execute([ScheduledChunk("r", prompt[:24], 0, blocks, False)])
    logits = runner.execute([ScheduledChunk("r", prompt[24:], 24, blocks, True)])[0]
    out = [logits]
    token, pos = int(logits[0].argmax()), len(prompt)
    for _ in range(num_decodes):
        logits = runner.execute([ScheduledChunk("r", [token], pos, blocks, True)])[0]
        out.append(logits)
        token, pos = int(logits[0].argmax()), pos + 1
    return torch.cat(out)


@pytest.mark.parametrize("name, tolerance", [("float32", 0.0), ("bfloat16", 0.01), ("float16", 0.002),
                                             ("fp8_e4m3", 0.05)])
def test_attention_with_each_kv_dtype_matches_a_float32_cache(tiny_model, name, tolerance):
    """The second prefill chunk and every decode read the cache as stored: the logits move by at
    most `tolerance` of their spread."""
    prompt = [(7 * i + 3) % 1000 for i in range(40)]
    expected = _logits(tiny_model, "float32", prompt, 8)
    got = _logits(tiny_model, name, prompt, 8)
    spread = float(expected.max() - expected.min())
    error = float((got - expected).abs().max()) / spread
    assert error <= tolerance, f"{name}: {error:.4f} of the logits' spread"
    if name != "float32":
        assert error > 0, "the cache was not stored in the lower precision"
