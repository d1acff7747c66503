"""What pdserve needs to know about a checkpoint, parsed once from its Hugging Face `config.json`.

Runs in every process that touches the model (engine and TP ranks). Accepts both the transformers 4
(`rope_theta`, `rope_scaling`, `torch_dtype`) and transformers 5 (`rope_parameters`, `dtype`) spellings.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import torch

# architecture name in config.json -> (qkv bias by default, per-head q/k RMSNorm)
_ARCHITECTURES = {
    "LlamaForCausalLM": (False, False),
    "MistralForCausalLM": (False, False),
    "Qwen2ForCausalLM": (True, False),
    "Qwen3ForCausalLM": (False, True),
}

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class UnsupportedModelError(ValueError):
    """The checkpoint's config asks for something pdserve cannot run."""


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: tuple[tuple[str, object], ...]  # sorted items; () when plain RoPE
    max_model_len: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    sliding_window: int | None
    checkpoint_dtype: str
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    @property
    def torch_checkpoint_dtype(self) -> torch.dtype:
        return _DTYPES[self.checkpoint_dtype]

    def fingerprint(self) -> str:
        """A short digest of everything that shapes the KV cache or its contents."""
        raw = json.dumps(dataclasses.asdict(self), sort_keys=True, default=str)
        return hashlib.sha256(raw.encode()).hexdigest()[:16]

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ModelSpec":
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no config.json in model directory {model_dir}")
        spec = cls.from_config(json.loads(path.read_text()))
        gen_path = Path(model_dir) / "generation_config.json"
        if gen_path.is_file():  # Llama 3 lists its extra end-of-turn ids only here
            eos = json.loads(gen_path.read_text()).get("eos_token_id")
            extra = eos if isinstance(eos, list) else ([] if eos is None else [eos])
            merged = tuple(dict.fromkeys([*spec.eos_token_ids, *map(int, extra)]))
            spec = dataclasses.replace(spec, eos_token_ids=merged)
        return spec

    @classmethod
    def from_config(cls, cfg: dict) -> "ModelSpec":
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in _ARCHITECTURES), None)
        if arch is None:
            raise UnsupportedModelError(
                f"unknown architecture {archs!r} in config.json; supported: {sorted(_ARCHITECTURES)}"
            )
        default_bias, qk_norm = _ARCHITECTURES[arch]
        num_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        head_dim = cfg.get("head_dim") or hidden // num_heads
        num_kv_heads = int(cfg.get("num_key_value_heads") or num_heads)
        if num_heads % num_kv_heads:
            raise UnsupportedModelError(
                f"num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv_heads}"
            )
        rope = dict(cfg.get("rope_parameters") or {})
        rope_theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
        if not rope and cfg.get("rope_scaling"):
            rope = dict(cfg["rope_scaling"])
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "llama3"):
            raise UnsupportedModelError(f"rope type {rope_type!r} is not supported (default, llama3)")
        rope_scaling = () if rope_type == "default" else tuple(sorted(rope.items()))
        if cfg.get("partial_rotary_factor", 1.0) != 1.0:
            raise UnsupportedModelError("partial_rotary_factor != 1 is not supported")
        sliding_window = cfg.get("sliding_window")
        if arch.startswith("Qwen") and not cfg.get("use_sliding_window", False):
            sliding_window = None
        dtype = str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32").replace("torch.", "")
        if dtype not in _DTYPES:
            raise UnsupportedModelError(f"checkpoint dtype {dtype!r} is not supported")
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=int(head_dim),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_model_len=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=bool(cfg.get("attention_bias", default_bias)),
            qk_norm=qk_norm,
            sliding_window=int(sliding_window) if sliding_window else None,
            checkpoint_dtype=dtype,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )


def resolve_dtype(name: str, spec: ModelSpec) -> torch.dtype:
    """`auto` runs in the checkpoint's dtype; float16 runs as float32 on CPU (no fast kernels)."""
    if name == "auto":
        dtype = spec.torch_checkpoint_dtype
    elif name in _DTYPES:
        dtype = _DTYPES[name]
    else:
        raise ValueError(f"dtype must be one of auto, {', '.join(_DTYPES)}; got {name!r}")
    if dtype == torch.float16 and not torch.cuda.is_available():
        dtype = torch.float32
    return dtype
