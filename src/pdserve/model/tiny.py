"""`pdserve make-model`: write a random-weight Llama checkpoint in Hugging Face layout, offline.

Deterministic from a seed. Weights are scaled so each layer has unit-scale outputs (attention is
far from uniform, so the KV cache matters) and the LM head is scaled so logits have clear margins
(docs/design.md, "Correctness"): greedy comparisons between engines are then meaningful.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from pdserve.model.tiny_tokenizer import BOS_ID, EOS_ID, train_tokenizer, write_tokenizer


@dataclasses.dataclass(frozen=True)
class Preset:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_model_len: int


PRESETS = {
    "tiny": Preset(vocab_size=1024, hidden_size=128, intermediate_size=256, num_layers=2,
                   num_heads=4, num_kv_heads=2, head_dim=32, max_model_len=2048),
    "small": Preset(vocab_size=8192, hidden_size=512, intermediate_size=1408, num_layers=8,
                    num_heads=8, num_kv_heads=4, head_dim=64, max_model_len=4096),
}

LOGIT_STD = 8.0  # target spread of the logits; top-2 gaps below 1e-4 become very rare


def make_model(out_dir: str | Path, preset: str = "tiny", seed: int = 0, num_kv_heads: int | None = None,
               dtype: str = "float32", num_shards: int = 1) -> Path:
    if preset not in PRESETS:
        raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {preset!r}")
    p = PRESETS[preset]
    if num_kv_heads is not None:
        if num_kv_heads < 1 or p.num_heads % num_kv_heads:
            raise ValueError(f"num_kv_heads={num_kv_heads} must divide num_heads={p.num_heads}")
        p = dataclasses.replace(p, num_kv_heads=num_kv_heads)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(p.vocab_size, seed)
    p = dataclasses.replace(p, vocab_size=tok.get_vocab_size())
    write_tokenizer(tok, out, p.max_model_len)
    tensors = _random_weights(p, seed)
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    tensors = {k: v.to(torch_dtype).contiguous() for k, v in tensors.items()}
    _save(tensors, out, num_shards)
    (out / "config.json").write_text(json.dumps(_hf_config(p, dtype), indent=2) + "\n")
    gen = {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": 0}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    return out


def _random_weights(p: Preset, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def normal(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    def linear(out_features: int, in_features: int) -> torch.Tensor:
        return normal(out_features, in_features, std=in_features ** -0.5)

    def norm(size: int) -> torch.Tensor:
        return 1.0 + normal(size, std=0.1)

    q, kv = p.num_heads * p.head_dim, p.num_kv_heads * p.head_dim
    w = {"model.embed_tokens.weight": normal(p.vocab_size, p.hidden_size, std=1.0)}
    for i in range(p.num_layers):
        pre = f"model.layers.{i}"
        w[f"{pre}.input_layernorm.weight"] = norm(p.hidden_size)
        w[f"{pre}.self_attn.q_proj.weight"] = linear(q, p.hidden_size)
        w[f"{pre}.self_attn.k_proj.weight"] = linear(kv, p.hidden_size)
        w[f"{pre}.self_attn.v_proj.weight"] = linear(kv, p.hidden_size)
        w[f"{pre}.self_attn.o_proj.weight"] = linear(p.hidden_size, q)
        w[f"{pre}.post_attention_layernorm.weight"] = norm(p.hidden_size)
        w[f"{pre}.mlp.gate_proj.weight"] = linear(p.intermediate_size, p.hidden_size)
        w[f"{pre}.mlp.up_proj.weight"] = linear(p.intermediate_size, p.hidden_size)
        w[f"{pre}.mlp.down_proj.weight"] = linear(p.hidden_size, p.intermediate_size)
    w["model.norm.weight"] = norm(p.hidden_size)
    w["lm_head.weight"] = normal(p.vocab_size, p.hidden_size, std=LOGIT_STD / p.hidden_size ** 0.5)
    return w


def _save(tensors: dict[str, torch.Tensor], out: Path, num_shards: int) -> None:
    for old in out.glob("*.safetensors"):
        old.unlink()
    if num_shards <= 1:
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        return
    names = list(tensors)
    weight_map = {}
    for s in range(num_shards):
        fname = f"model-{s + 1:05d}-of-{num_shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[s::num_shards]}
        save_file(part, str(out / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in part})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _hf_config(p: Preset, dtype: str) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": p.vocab_size,
        "hidden_size": p.hidden_size,
        "intermediate_size": p.intermediate_size,
        "num_hidden_layers": p.num_layers,
        "num_attention_heads": p.num_heads,
        "num_key_value_heads": p.num_kv_heads,
        "head_dim": p.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": p.max_model_len,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "torch_dtype": dtype,
    }
