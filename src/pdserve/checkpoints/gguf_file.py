"""GGUF files (llama.cpp's format) as pdserve checkpoints.

CLI process and `pdserve.LLM`, before any engine starts. A `.gguf` file is converted once into a
Hugging Face checkpoint directory in a cache: `config.json` from the file's metadata, the tokenizer
and its chat template (gguf_tokenizer.py), and `gguf_source.json` naming the file, from which every
TP rank reads the tensors themselves at load (model/gguf_weights.py: kept quantized by default, no
float copy of the model anywhere). The cache entry is named by the file's path, size and
modification time, written to a temporary directory and renamed into place, so concurrent starts
never see half a checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path


from pdserve.checkpoints.gguf_tokenizer import build_tokenizer

logger = logging.getLogger(__name__)

ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
SOURCE_FILE = "gguf_source.json"  # read by model/gguf_weights.py
_LAYOUT_VERSION = "2"  # 1 held the tensors dequantized to float32 safetensors
_DONE = ".converted"


class GGUFError(ValueError):
    """The file is not a GGUF pdserve can serve; the message says why."""


def is_gguf(model: str) -> bool:
    return model.endswith(".gguf") and Path(model).is_file()


def default_cache_root() -> Path:
    return Path.home() / ".cache" / "pdserve" / "gguf"


def checkpoint_dir(model: str, cache_root: Path | None = None) -> str:
    """The checkpoint directory to load: `model` itself, or a GGUF file's converted copy."""
    if not is_gguf(model):
        return model
    path = Path(model).resolve()
    stat = path.stat()
    key = hashlib.sha256(f"{path}|{stat.st_size}|{stat.st_mtime_ns}|{_LAYOUT_VERSION}".encode()).hexdigest()[:16]
    root = cache_root or default_cache_root()
    out = root / f"{path.stem}-{key}"
    if (out / _DONE).is_file():
        return str(out)
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".{out.name}.{os.getpid()}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    logger.info("converting %s to a checkpoint in %s (once)", path, out)
    try:
        convert(path, tmp)
        (tmp / _DONE).write_text(str(path))
        try:
            os.replace(tmp, out)
        except OSError:  # converted by someone else meanwhile
            if not (out / _DONE).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(out)


def convert(path: Path, out: Path) -> None:
    try:
        import gguf
    except ImportError:  # pragma: no cover - gguf is a dependency of pdserve
        raise GGUFError("reading GGUF files needs the `gguf` package: pip install gguf") from None
    reader = gguf.GGUFReader(str(path))
    meta = {name: field.contents() for name, field in reader.fields.items()
            if not name.startswith("GGUF.")}
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFError(f"{path.name}: architecture {arch!r} is not supported ({', '.join(ARCHITECTURES)})")
    names = {t.name for t in reader.tensors}
    config = _config(meta, arch, names)
    out.mkdir(parents=True)
    tokenizer, tokenizer_config = build_tokenizer({**meta, "context_length": config["max_position_embeddings"]})
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / SOURCE_FILE).write_text(json.dumps({"path": str(path)}))


def _config(meta: dict, arch: str, tensor_names: set[str]) -> dict:
    def get(key: str, default=None):
        return meta.get(f"{arch}.{key}", default)
    if "rope_freqs.weight" in tensor_names or get("rope.scaling.type", "none") not in ("none", None):
        raise GGUFError("RoPE scaling in a GGUF file (rope_freqs, rope.scaling.*) is not supported")
    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    tokens = meta.get("tokenizer.ggml.tokens") or []
    config = {
        "architectures": [ARCHITECTURES[arch]], "model_type": arch,
        "vocab_size": int(get("vocab_size") or len(tokens)),
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv") or heads),
        "head_dim": int(get("attention.key_length") or get("rope.dimension_count") or hidden // heads),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(get("context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32",
    }
    if get("attention.sliding_window"):
        config["sliding_window"] = int(get("attention.sliding_window"))
    return config
