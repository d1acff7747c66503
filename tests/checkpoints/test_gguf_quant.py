"""GGUF weights kept quantized: Q4_0, Q4_1 and Q4_K blocks decode to exactly the values the `gguf`
library dequantizes them to, Q8_0 to int8 within one step; a file loads into int8/int4 layers by
default without dequantizing its quantized tensors, `--quantization none` dequantizes as before,
and TP 2 shards the quantized layers to TP 1's logits."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf_writer import write_gguf
from tp_threads import last_logits

from pdserve.checkpoints.gguf_file import checkpoint_dir
from pdserve.model.gguf_weights import decode
from pdserve.model.linear import Int4Linear, Int8Linear, Linear
from pdserve.model.loader import load_model, weight_format
from pdserve.model.parallel import TPGroup
from pdserve.model.spec import ModelSpec

PROMPT = [1] + [(53 * i) % 1000 + 7 for i in range(40)]


def random_q4_k(rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Valid Q4_K blocks: random codes and 6-bit scales, small float16 super-block scales."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows * cols // 256, 144), dtype=np.uint8)
    blocks[:, 0:2] = (rng.random(len(blocks)) * 0.01).astype(np.float16)[:, None].view(np.uint8)
    blocks[:, 2:4] = (rng.random(len(blocks)) * 0.01).astype(np.float16)[:, None].view(np.uint8)
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q4_K"])
def test_int4_blocks_decode_to_the_librarys_values(kind):
    import gguf
    from gguf import GGMLQuantizationType as T
    rows, cols = 48, 512
    if kind == "Q4_K":
        raw = random_q4_k(rows, cols)
    else:
        w = np.random.default_rng(1).standard_normal((rows, cols)).astype(np.float32)
        raw = gguf.quants.quantize(w, T[kind])
    want = torch.from_numpy(gguf.quants.dequantize(raw, T[kind]).reshape(rows, cols))
    q = decode(kind, raw, (rows, cols))
    assert q.format == "int4" and q.group_size == 32 and q.codes.max() <= 15
    torch.testing.assert_close(q.dequantize(), want, rtol=1e-5, atol=1e-6)


def test_q8_0_becomes_int8_within_one_step_of_each_row():
    import gguf
    from gguf import GGMLQuantizationType as T
    w = np.random.default_rng(2).standard_normal((32, 256)).astype(np.float32)
    raw = gguf.quants.quantize(w, T.Q8_0)
    want = torch.from_numpy(gguf.quants.dequantize(raw, T.Q8_0).reshape(32, 256))
    q = decode("Q8_0", raw, (32, 256))
    assert q.format == "int8" and q.codes.dtype == torch.int8
    assert ((q.dequantize() - want).abs() <= q.scales[:, None] / 2 + 1e-6).all()


@pytest.fixture(scope="module")
def files(tiny_model, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("gguf-quant")
    return {qtype: checkpoint_dir(str(write_gguf(tiny_model, root / f"{qtype}.gguf", qtype)), root / "cache")
            for qtype in ("Q4_1", "Q8_0")}


def test_a_gguf_file_loads_kept_quantized_by_default(files, monkeypatch):
    import gguf
    dequantized = []
    real = gguf.quants.dequantize
    monkeypatch.setattr(gguf.quants, "dequantize", lambda data, qtype: dequantized.append(qtype) or real(data, qtype))
    assert not list(Path(files["Q4_1"]).glob("*.safetensors"))  # no float copy on disk either
    spec = ModelSpec.from_dir(files["Q4_1"])
    model = load_model(files["Q4_1"], spec, TPGroup(0, 1), torch.float32)
    assert {q.name for q in dequantized} == {"F32"}  # only the norms: no quantized tensor went through floats
    layer = model.layers[0]
    assert all(isinstance(lin, Int4Linear) for lin in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj,
                                                       layer.down_proj))
    assert isinstance(model.lm_head, Int4Linear)
    dequantized.clear()
    plain = load_model(files["Q4_1"], spec, TPGroup(0, 1), torch.float32, "none")
    assert isinstance(plain.layers[0].qkv_proj, Linear) and "Q4_1" in {q.name for q in dequantized}
    assert model.weight_bytes() < 0.25 * plain.weight_bytes()
    eight = load_model(files["Q8_0"], spec, TPGroup(0, 1), torch.float32)
    assert isinstance(eight.layers[0].down_proj, Int8Linear)
    assert eight.weight_bytes() < 0.35 * plain.weight_bytes()


def test_quantized_and_dequantized_answers_agree(files):
    full = last_logits(files["Q4_1"], 1, "none", PROMPT)
    kept = last_logits(files["Q4_1"], 1, None, PROMPT)
    assert float((kept - full).norm() / full.norm()) < 0.02  # bfloat16 activations, same weights
    assert kept.argmax() == full.argmax()


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
def test_tp2_shards_gguf_weights_to_tp1s_logits(files, qtype):
    one = last_logits(files[qtype], 1, None, PROMPT)
    two = last_logits(files[qtype], 2, None, PROMPT)
    assert float((two - one).norm() / one.norm()) < 0.01
    assert two.argmax() == one.argmax()


def test_the_weight_format_names_the_files_types(files, tiny_model):
    assert weight_format(files["Q4_1"], None) == "gguf/F32,Q4_1"
    assert weight_format(files["Q4_1"], "int8") == "int8/F32,Q4_1"
    assert weight_format(files["Q8_0"], None) == "gguf/F32,Q8_0"
    assert weight_format(tiny_model, None) == weight_format(tiny_model, "none") == "none"
    assert weight_format(tiny_model, "int4") == "int4"
