"""A decode step's layers in one native call (model/fused_decode.py) against the layer-by-layer path:
the same hidden states bit for bit, on every decode step of real generations."""

from __future__ import annotations

import pytest
import torch
from helpers import MARCHES

from pdserve import SamplingParams
from pdserve.model import kernels

PROMPT_LENGTHS = [5, 16, 31]  # one sequence crosses a block boundary while it decodes (block size 16)


@pytest.fixture(params=MARCHES)
def march(request, monkeypatch):
    """Built for this CPU and for AVX2 (the kernels the C loop calls are each march's)."""
    monkeypatch.setattr(kernels, "MARCH", request.param)
    return request.param


def _checked(model) -> list[int]:
    """Make every fused step also run the Python layers on a copy of its input and compare (the KV
    they write is the same, so the second write changes nothing when they agree). Returns the list
    the row counts of the compared steps go to."""
    fused, compared = model.fused_decode, []

    class Checked:
        def takes(self, *args):
            return fused.takes(*args)

        def __call__(self, x, positions, kv_caches, meta):
            expected = model.run_layers(x.clone(), positions, kv_caches, meta)
            got = fused(x, positions, kv_caches, meta)
            assert torch.equal(got, expected), f"rows {x.shape[0]}: {(got - expected).abs().max()}"
            compared.append(x.shape[0])
            return got
    model.fused_decode = Checked()
    return compared


def _generate(llm, max_tokens: int = 12):
    prompts = [[1] + [(13 * i + 7 * n) % 900 + 7 for i in range(n - 1)] for n in PROMPT_LENGTHS]
    return llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))


@pytest.mark.parametrize("quantization", ["int4", "int8"])
@pytest.mark.parametrize("kv_cache_dtype", ["float32", "bfloat16", "fp8_e4m3"])
def test_fused_decode_steps_equal_the_layer_by_layer_path(make_llm, tiny_model, march, quantization,
                                                          kv_cache_dtype):
    llm = make_llm(tiny_model, quantization=quantization, kv_cache_dtype=kv_cache_dtype, num_blocks=64)
    model = llm.engine.executor.local.model
    assert model.fused_decode is not None
    compared = _checked(model)
    _generate(llm)
    assert max(compared) == len(PROMPT_LENGTHS) and min(compared) >= 1
    assert len(compared) >= 11  # every step after the prefills


@pytest.mark.parametrize("kind", ["qwen2", "mistral"])  # a qkv bias; a sliding window shorter than the prompts
def test_fused_decode_on_other_layouts(make_llm, hf_checkpoint, kind):
    llm = make_llm(hf_checkpoint(kind), quantization="int4", dtype="float32", num_blocks=64)
    model = llm.engine.executor.local.model
    assert model.fused_decode is not None
    compared = _checked(model)
    _generate(llm)
    assert len(compared) >= 11


def test_greedy_answers_are_the_same_with_and_without_it(make_llm, tiny_model):
    llm = make_llm(tiny_model, quantization="int4", num_blocks=64)
    model = llm.engine.executor.local.model
    fused = [o.outputs[0].token_ids for o in _generate(llm, 24)]
    model.fused_decode = None
    assert [o.outputs[0].token_ids for o in _generate(llm, 24)] == fused


@pytest.mark.parametrize("quantization, tp", [("none", 1), ("int4", 2)])
def test_float_weights_and_tp_2_take_the_python_path(make_llm, tiny_model, quantization, tp):
    llm = make_llm(tiny_model, tp, num_blocks=64, quantization=quantization)
    assert llm.engine.executor.local.model.fused_decode is None  # rank 0's; TP 2 all-reduces inside a layer
    assert _generate(llm, 4)[0].outputs[0].token_ids
