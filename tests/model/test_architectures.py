"""Real-checkpoint layouts load with the same code and give transformers' greedy answers.

Each checkpoint is written by transformers' own model class with random weights: Llama 3 (llama3
rope scaling, sharded safetensors), Qwen2 (qkv bias, tied embeddings), Qwen3 (q/k norm, head_dim not
hidden/heads), Mistral (sliding window shorter than the prompts), and a bfloat16 Llama.
"""

from __future__ import annotations

import random

import pytest
import torch

from helpers import ARCHITECTURES, assert_greedy_match, hf_reference
from pdserve import SamplingParams

LENGTHS = [6, 16, 45]


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[1] + [rng.randrange(7, 1024) for _ in range(n - 1)] for n in LENGTHS]


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("kind", ARCHITECTURES)
def test_architecture_matches_transformers(make_llm, hf_checkpoint, kind, tp):
    path = hf_checkpoint(kind)
    # bfloat16 weights are run in float32 on both sides: the comparison is about the layout.
    llm = make_llm(path, tp, dtype="float32", num_blocks=64)
    prompts = _prompts(seed=len(kind))
    params = SamplingParams(temperature=0.0, max_tokens=20)
    outs = llm.generate(prompts, params)
    for p, out in zip(prompts, outs):
        ref = hf_reference(path, p, params.max_tokens, dtype=torch.float32)
        assert_greedy_match(out.outputs[0].token_ids, ref, f"{kind} tp{tp} len{len(p)}")
    llm.shutdown()


def test_bfloat16_runs_in_checkpoint_dtype(make_llm, hf_checkpoint):
    """dtype=auto keeps bfloat16; answers agree with float32 on most tokens (not a greedy-equality comparison)."""
    path = hf_checkpoint("llama-bf16")
    llm = make_llm(path, 1, num_blocks=64)
    assert llm.engine.dtype == torch.bfloat16
    out = llm.generate([_prompts(1)[2]], SamplingParams(temperature=0.0, max_tokens=8))[0]
    ref = hf_reference(path, _prompts(1)[2], 8, dtype=torch.bfloat16)
    assert out.outputs[0].token_ids[:2] == ref.tokens[:2]
    llm.shutdown()


def test_unknown_architecture_is_a_clear_error(tmp_path, tiny_model):
    import json
    import shutil

    from pdserve import LLM
    from pdserve.model.spec import UnsupportedModelError
    shutil.copytree(tiny_model, tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel"):
        LLM(str(tmp_path / "m"))
