"""Shared test helpers: checkpoints written by transformers' own classes, and the greedy reference.

docs/design.md, "Correctness": greedy outputs must equal transformers' token for token; a divergence is allowed only at a
step where the reference's top-2 logit gap is below 1e-4, and tests report how often that happened.
"""

from __future__ import annotations

import dataclasses
import random
import shutil
from pathlib import Path

import pytest
import torch

GAP_EPS = 1e-4
# the CPU's flags, read here apart from the code under test (pdserve.model.kernels reads them too)
CPU_FLAGS = frozenset(Path("/proc/cpuinfo").read_text().split()) if Path("/proc/cpuinfo").exists() else frozenset()
# the C kernels as built for this CPU, and their AVX2 build (`-march=haswell`: 8-lane code paths an
# AVX-512 CPU's own build never takes), which any AVX2 CPU runs
MARCHES = ["native", pytest.param("haswell", marks=pytest.mark.skipif(
    not {"avx2", "fma", "f16c"} <= CPU_FLAGS, reason="the AVX2 build needs AVX2, FMA and F16C"))]
_REFERENCE_CACHE: dict = {}
DIVERGENCES: list[str] = []  # reported at the end of the session (see conftest)


@dataclasses.dataclass
class Reference:
    tokens: list[int]
    gaps: list[float]  # top-2 logit gap of the reference at each generated step
    top_logprobs: list[list[tuple[int, float]]]


def hf_reference(model_dir: str, prompt_ids: list[int], max_new_tokens: int, dtype=torch.float32,
                 num_top: int = 5, gguf_file: str | None = None) -> Reference:
    """transformers' greedy answer (`gguf_file`: its GGUF loader reads that file in `model_dir`)."""
    key = (str(model_dir), gguf_file, tuple(prompt_ids), max_new_tokens, str(dtype))
    if key not in _REFERENCE_CACHE:
        from transformers import AutoModelForCausalLM
        model_key = (str(model_dir), gguf_file, str(dtype))
        if model_key not in _REFERENCE_CACHE:
            _REFERENCE_CACHE[model_key] = AutoModelForCausalLM.from_pretrained(
                model_dir, dtype=dtype, gguf_file=gguf_file).eval()
        model = _REFERENCE_CACHE[model_key]
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens,
                                 min_new_tokens=0, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True, pad_token_id=0)
        tokens = out.sequences[0, len(prompt_ids):].tolist()
        gaps, tops = [], []
        for logits in out.logits:
            lf = logits[0].float()
            top2 = lf.topk(2).values
            gaps.append(float(top2[0] - top2[1]))
            lp = torch.log_softmax(lf, -1)
            v, i = lp.topk(num_top)
            tops.append(list(zip(i.tolist(), v.tolist())))
        eos = model.generation_config.eos_token_id
        eos = set(eos if isinstance(eos, list) else [eos]) if eos is not None else set()
        for n, t in enumerate(tokens):  # transformers pads after EOS
            if t in eos:
                tokens = tokens[:n + 1]
                break
        _REFERENCE_CACHE[key] = Reference(tokens, gaps[:len(tokens)], tops[:len(tokens)])
    return _REFERENCE_CACHE[key]


def assert_greedy_match(ours: list[int], ref: Reference, label: str = "") -> None:
    """Token-for-token equality, except a divergence at a step whose reference gap < GAP_EPS."""
    for i, (a, b) in enumerate(zip(ours, ref.tokens)):
        if a != b:
            assert ref.gaps[i] < GAP_EPS, (
                f"{label}: token {i} differs (ours {a}, reference {b}) with a clear reference "
                f"top-2 gap of {ref.gaps[i]:.3g}\nours={ours}\nref ={ref.tokens}")
            DIVERGENCES.append(f"{label}: step {i}, gap {ref.gaps[i]:.2e}")
            return
    assert len(ours) == len(ref.tokens), f"{label}: lengths differ\nours={ours}\nref ={ref.tokens}"


def _init_weights(model, seed: int, logit_std: float = 8.0) -> None:
    """Unit-scale layers (attention far from uniform) and a scaled head (clear logit margins)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            elif "lm_head" in name:
                p.copy_(torch.randn(p.shape, generator=g) * logit_std / p.shape[1] ** 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5)
        if model.config.tie_word_embeddings:  # the shared matrix must give clear margins too
            emb = model.get_input_embeddings().weight
            emb.mul_(logit_std / emb.shape[1] ** 0.5)


ARCHITECTURES = ["llama3", "qwen2", "qwen3", "mistral", "llama-bf16"]


def write_hf_checkpoint(kind: str, out: Path, tokenizer_dir: Path) -> Path:
    """A random-weight checkpoint written by transformers' own model classes (nothing downloaded)."""
    import transformers as tf
    common = dict(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0)
    save_kwargs = {}
    dtype = torch.float32
    if kind == "llama3":
        config = tf.LlamaConfig(**common, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64}, rope_theta=500000.0)
        cls = tf.LlamaForCausalLM
        save_kwargs["max_shard_size"] = "300KB"  # sharded safetensors with an index
    elif kind == "qwen2":
        config = tf.Qwen2Config(**common, tie_word_embeddings=True)
        cls = tf.Qwen2ForCausalLM
    elif kind == "qwen3":
        config = tf.Qwen3Config(**{**common, "hidden_size": 96}, head_dim=32)
        cls = tf.Qwen3ForCausalLM
    elif kind == "mistral":
        config = tf.MistralConfig(**common, sliding_window=8)
        cls = tf.MistralForCausalLM
    elif kind == "llama-bf16":
        config = tf.LlamaConfig(**common)
        cls = tf.LlamaForCausalLM
        dtype = torch.bfloat16
    elif kind == "llama-256":  # rows of 256: K-quant blocks fit every matrix
        config = tf.LlamaConfig(**{**common, "hidden_size": 256, "intermediate_size": 512})
        cls = tf.LlamaForCausalLM
    elif kind == "qwen3-hd128":  # transformers' GGUF loader takes Qwen3's head_dim to be 128, always
        config = tf.Qwen3Config(**common, head_dim=128)
        cls = tf.Qwen3ForCausalLM
    else:
        raise ValueError(kind)
    torch.manual_seed(0)
    model = cls(config)
    _init_weights(model, seed=(ARCHITECTURES + ["llama-256", "qwen3-hd128"]).index(kind))
    model = model.to(dtype)
    model.save_pretrained(out, **save_kwargs)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(tokenizer_dir / name, out / name)
    return out


def ids(n: int, seed: int) -> list[int]:
    """A prompt of n token ids: BOS, then seeded ids every generated test model knows."""
    rng = random.Random(seed)
    return [1] + [rng.randrange(7, 1000) for _ in range(n - 1)]
