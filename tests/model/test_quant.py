"""Quantized weights: int8/int4 layers on torch's kernels compute what their weights say, stay
quantized in memory, shard for TP like float ones (TP 2 logits equal TP 1's), and int8 keeps the
generated model's perplexity close to float32's (as does bfloat16)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import CPU_FLAGS, MARCHES
from tp_threads import last_logits

from pdserve.model import kernels
from pdserve.model.embedding import Embedding
from pdserve.model.linear import Int4Linear, Int8Linear, Linear, make_linear, weight_bytes
from pdserve.model.quant import quantize, quantize_int4, quantize_int8

TEXT = Path(__file__).resolve().parent.parent / "data" / "prose.txt"
HAS_NATIVE = {"avx2", "fma", "f16c"} <= CPU_FLAGS  # kernels/int4_linear.c builds (AVX2 or AVX512-VNNI)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


@pytest.fixture(params=MARCHES)
def march(request, monkeypatch):
    """kernels/int4_linear.c as built for this CPU, and its AVX2 build (int4_linear_avx2.h, which an
    AVX-512 CPU's own build never runs)."""
    monkeypatch.setattr(kernels, "MARCH", request.param)
    return request.param


@pytest.mark.parametrize("fmt, layer", [("int8", Int8Linear), ("int4", Int4Linear)])
@pytest.mark.parametrize("out_features, in_features", [(96, 64), (40, 576), (37, 128)])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 33])
def test_quantized_layers_compute_their_weights_product(fmt, layer, out_features, in_features, rows, march):
    g = torch.Generator().manual_seed(rows * out_features)
    w = torch.randn(out_features, in_features, generator=g) / in_features ** 0.5
    x = torch.randn(rows, in_features, generator=g)
    q = quantize(w, fmt)
    lin = make_linear(q, torch.float32)
    assert isinstance(lin, layer)
    assert lin.native == HAS_NATIVE  # kernels/int4_linear.c where it builds, else torch's
    y = lin(x)
    assert y.shape == (rows, out_features) and y.dtype == torch.float32
    # activations rounded (bfloat16, or int8 per 32 in the native int4 kernel): what the weights say
    assert relative_error(y, x @ q.dequantize().t()) < 0.015
    assert relative_error(y, x @ w.t()) < (0.02 if fmt == "int8" else 0.15)
    rows16 = -(-out_features // 16) * 16  # rows padded to sixteens, one per vector lane
    if fmt == "int8" and HAS_NATIVE:  # a byte per weight and a float32 scale per row
        assert weight_bytes(lin) == rows16 * (in_features + 4)
    elif fmt == "int8":  # torch's layout: a bfloat16 scale per row
        assert weight_bytes(lin) == out_features * (in_features + 2)
    else:  # half a byte per weight, a 16-bit scale and zero per 32
        assert weight_bytes(lin) == rows16 * (in_features // 2 + in_features // 32 * 4)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_row_counts_and_threads_sharing_scratch_get_their_own_products(fmt, march):
    """The native kernels quantize activations into per-thread scratch that grows and is reused:
    calls of other row counts, and other threads at the same time, must not see each other's."""
    from concurrent.futures import ThreadPoolExecutor
    g = torch.Generator().manual_seed(7)
    lin = make_linear(quantize(torch.randn(48, 96, generator=g), fmt), torch.float32)
    inputs = [torch.randn(rows, 96, generator=g) for rows in (3, 40, 1, 17, 40, 2)]
    alone = [lin(x) for x in inputs]
    for x, want in zip(inputs, alone):  # again, after the scratch grew
        torch.testing.assert_close(lin(x), want, rtol=0, atol=0)

    def run(i: int) -> list[torch.Tensor]:
        return [lin(inputs[(i + j) % len(inputs)]) for j in range(60)]

    with ThreadPoolExecutor(4) as pool:
        for i, outs in enumerate(pool.map(run, range(4))):
            for j, y in enumerate(outs):
                torch.testing.assert_close(y, alone[(i + j) % len(inputs)], rtol=0, atol=0)


def test_an_input_size_the_kernels_cannot_take_runs_dense():
    w = torch.randn(24, 20)
    lin = make_linear(quantize_int8(w), torch.float32)
    assert isinstance(lin, Linear)
    x = torch.randn(3, 20)
    torch.testing.assert_close(lin(x), x @ quantize_int8(w).dequantize().t(), rtol=1e-5, atol=1e-5)


def test_quantized_columns_split_on_group_boundaries_only():
    q = quantize_int4(torch.randn(16, 128))
    torch.testing.assert_close(q.cols(slice(64, 128)).dequantize(), q.dequantize()[:, 64:])
    with pytest.raises(ValueError, match="cannot be split"):
        q.cols(slice(0, 48))


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_quantized_embeddings_look_up_the_dequantized_rows(fmt):
    table = torch.randn(100, 64)
    q = quantize_int8(table) if fmt == "int8" else quantize_int4(table)
    ids = torch.tensor([0, 99, 7, 7])
    torch.testing.assert_close(Embedding(q, torch.float32)(ids), q.dequantize()[ids])
    assert Embedding(q, torch.float32).nbytes() < table.numel() * table.element_size() / 2
    if fmt == "int8":  # a tied table reads the LM head's packed codes, keeping no copy of its own
        head = Int8Linear(q)
        shared = Embedding(q, torch.float32, head.row_codes)
        torch.testing.assert_close(shared(ids), q.dequantize()[ids])
        assert shared.nbytes() == 100 * 4  # its scales only


PROMPT = [1] + [(37 * i) % 1000 + 7 for i in range(40)]


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_tp2_logits_equal_tp1(tiny_model, quantization):
    one = last_logits(tiny_model, 1, quantization, PROMPT)
    two = last_logits(tiny_model, 2, quantization, PROMPT)
    assert relative_error(two, one) < 0.01
    assert two.argmax() == one.argmax()
    full = last_logits(tiny_model, 1, None, PROMPT)
    assert relative_error(one, full) > 1e-4  # the quantized weights were used


@pytest.fixture(scope="module")
def prose_ids(tiny_model) -> list[int]:
    from pdserve.text.tokenizer import Tokenizer
    return Tokenizer(tiny_model).encode(TEXT.read_text())[:1024]


@pytest.mark.parametrize("dtype, quantization", [("float32", "int8"), ("bfloat16", "none")])
def test_the_generated_models_perplexity_stays_near_float32s(tiny_model, prose_ids, dtype, quantization):
    from pdserve.bench.quality import Scorer, agreement
    full = Scorer(tiny_model, window=256).score(prose_ids)
    other = Scorer(tiny_model, dtype=dtype, quantization=quantization, window=256).score(prose_ids)
    assert full.num_tokens == other.num_tokens == len(prose_ids) - 1
    assert abs(other.perplexity / full.perplexity - 1) < 0.05
    assert agreement(other, full) > 0.9
