"""GGUF files of Hugging Face checkpoints, written the way llama.cpp's converter writes them (names,
Q/K row order, metadata keys), with the `gguf` library, for the GGUF tests.

The `gguf` library quantizes Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1 but only dequantizes K-quants, so a
plain Q6_K encoder is here: any valid blocks do, since pdserve and transformers read the same bytes.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from pdserve.model import gguf_weights

ARCH = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama",  # llama.cpp writes Mistral as llama
        "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}
# llama.cpp's names, the other way round (transformers' GGUF loader checks them independently)
_LAYER = {hf: name for name, hf in gguf_weights.LAYER.items()}
_GLOBAL = {hf: name for name, hf in gguf_weights.GLOBAL.items()}


def gguf_name(hf: str) -> str:
    if hf in _GLOBAL:
        return _GLOBAL[hf]
    parts = hf.split(".", 3)  # model.layers.N.rest
    return f"blk.{parts[2]}.{_LAYER[parts[3]]}"


def write_gguf(model_dir: str | Path, out: Path, qtype: str = "Q8_0", name: str = "test model") -> Path:
    import gguf
    from safetensors.numpy import load_file
    model_dir = Path(model_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    arch = ARCH[cfg["architectures"][0]]
    heads, kv_heads = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    w = gguf.GGUFWriter(str(out), arch)
    w.add_name(name)
    w.add_context_length(cfg.get("max_position_embeddings", 2048))
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(cfg.get("rms_norm_eps", 1e-6))
    w.add_rope_freq_base(cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta", 1e4))
    w.add_rope_dimension_count(head_dim)
    if arch == "qwen3":
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_vocab_size(cfg["vocab_size"])
    _tokenizer(w, model_dir)
    tensors = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    for hf, data in sorted(tensors.items()):
        data = data.astype(np.float32)
        if arch == "llama" and hf.endswith(("q_proj.weight", "k_proj.weight")):
            data = _permute(data, heads if "q_proj" in hf else kv_heads)
        _add_tensor(w, gguf_name(hf), data, qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _add_tensor(w, name: str, data: np.ndarray, qtype: str) -> None:
    import gguf
    from gguf import GGMLQuantizationType as T
    t = T[qtype]
    block = gguf.GGML_QUANT_SIZES[t][0]
    if data.ndim == 1 or data.shape[-1] % block:  # norms and odd rows stay float32, as llama.cpp does
        w.add_tensor(name, np.ascontiguousarray(data))
    elif t == T.Q6_K:
        w.add_tensor(name, quantize_q6_k(data), raw_dtype=T.Q6_K)
    else:
        w.add_tensor(name, gguf.quants.quantize(data, t), raw_dtype=t)


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's Q/K row order (convert_hf_to_gguf's `permute`)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tokenizer(w, model_dir: Path) -> None:
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    vocab = dict(tok["model"]["vocab"])
    special = {}
    for added in tok.get("added_tokens", []):
        vocab[added["content"]] = added["id"]
        special[added["id"]] = added.get("special", False)
    tokens = [None] * (max(vocab.values()) + 1)
    for token, i in vocab.items():
        tokens[i] = token
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"].get("merges", [])]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if special.get(i) else 1 for i in range(len(tokens))])
    w.add_token_merges(merges)
    cfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    for key, add in (("bos_token", w.add_bos_token_id), ("eos_token", w.add_eos_token_id)):
        text = cfg.get(key)
        text = text.get("content") if isinstance(text, dict) else text
        if text in vocab:
            add(vocab[text])
    w.add_add_bos_token(bool(cfg.get("add_bos_token", False)))
    if isinstance(cfg.get("chat_template"), str):
        w.add_chat_template(cfg["chat_template"])


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """Rows of `x` (a multiple of 256 long) as Q6_K blocks: per 16 values an int8 scale, per 256 a
    float16 scale, 6-bit quants split into low nibbles and high bit pairs (ggml's block_q6_K)."""
    rows = x.shape[0]
    blocks = x.reshape(-1, 256).astype(np.float32)
    n = len(blocks)
    sub = blocks.reshape(n, 16, 16)
    sub_scale = np.abs(sub).max(-1) / 31  # |q - 32| <= 31
    d = (sub_scale.max(-1, keepdims=True) / 127).astype(np.float16)
    d32 = d.astype(np.float32)
    scales = np.clip(np.round(np.divide(sub_scale, d32, out=np.zeros_like(sub_scale), where=d32 > 0)),
                     0, 127).astype(np.int8)
    eff = (d32 * scales)[..., None]
    q = np.round(np.divide(sub, eff, out=np.zeros_like(sub), where=eff > 0)) + 32
    q = np.clip(q, 0, 63).astype(np.uint8).reshape(n, 256)
    ql = np.zeros((n, 128), np.uint8)
    qh = np.zeros((n, 64), np.uint8)
    for g in range(2):
        for s in range(2):
            ql[:, g * 64:(g + 1) * 64] |= (q[:, g * 128 + s * 64:g * 128 + (s + 1) * 64] & 0x0F) << (4 * s)
        for k in range(4):
            qh[:, g * 32:(g + 1) * 32] |= ((q[:, g * 128 + k * 32:g * 128 + (k + 1) * 32] >> 4) & 0x03) << (2 * k)
    out = np.concatenate([ql, qh, scales.view(np.uint8), d.view(np.uint8)], axis=1)
    return out.reshape(rows, -1)
