"""The tensors of a GGUF file (llama.cpp's format) as this model's weights, read one at a time.

Every TP rank, at load, for a checkpoint directory that checkpoints/gguf_file.py converted from a
GGUF file (it holds config.json, the tokenizer and `gguf_source.json` naming the file). Names are
mapped to Hugging Face's and llama.cpp's Q/K row order (Llama, Mistral) is undone. By default a
tensor keeps its quantization: Q8_0 becomes int8 (per output row), Q4_0, Q4_1 and Q4_K become
int4 codes in groups of 32 with exact scales and zeros; other types are dequantized with the `gguf`
library, as is everything with `--quantization none`. Only one tensor is ever dequantized at a time.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import torch

from pdserve.model.quant import QuantizedWeight, Weight, quantize_for, quantize_int8

SOURCE_FILE = "gguf_source.json"  # written beside config.json by checkpoints/gguf_file.py
PERMUTED = {"llama", "mistral"}  # llama.cpp reorders their Q/K rows for its rotary layout
GLOBAL = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
          "output.weight": "lm_head.weight"}
LAYER = {"attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
         "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
         "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
         "attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
         "attn_v.bias": "self_attn.v_proj.bias", "attn_q_norm.weight": "self_attn.q_norm.weight",
         "attn_k_norm.weight": "self_attn.k_norm.weight", "ffn_gate.weight": "mlp.gate_proj.weight",
         "ffn_up.weight": "mlp.up_proj.weight", "ffn_down.weight": "mlp.down_proj.weight"}
_BLOCK = re.compile(r"blk\.(\d+)\.(.+)")
KEPT = {"Q8_0": "int8", "Q4_0": "int4", "Q4_1": "int4", "Q4_K": "int4"}  # GGUF type -> pdserve format


def hf_name(name: str) -> str | None:
    if name in GLOBAL:
        return GLOBAL[name]
    m = _BLOCK.fullmatch(name)
    if m and m.group(2) in LAYER:
        return f"model.layers.{m.group(1)}.{LAYER[m.group(2)]}"
    return None


def source_file(model_dir: str | Path) -> Path | None:
    """The GGUF file a converted checkpoint directory reads its weights from, if it is one."""
    path = Path(model_dir) / SOURCE_FILE
    if not path.is_file():
        return None
    gguf_path = Path(json.loads(path.read_text())["path"])
    if not gguf_path.is_file():
        raise FileNotFoundError(f"{model_dir} reads its weights from {gguf_path}, which is gone")
    return gguf_path


def tensor_types(gguf_path: Path) -> list[str]:
    """The file's tensor types, sorted (for the weight format in the P/D fingerprint)."""
    import gguf
    return sorted({t.tensor_type.name for t in gguf.GGUFReader(str(gguf_path)).tensors})


class GGUFWeights:
    """HF name -> weight, from the file's memory map. `quantization`: None keeps the file's formats
    (see KEPT); "none" dequantizes; "int8"/"int4" dequantize and quantize as for any checkpoint."""

    def __init__(self, gguf_path: Path, quantization: str | None):
        import gguf
        self.reader = gguf.GGUFReader(str(gguf_path))
        self.quantization = quantization
        arch = self.reader.fields["general.architecture"].contents()
        self.permuted = arch in PERMUTED
        self.heads = {"q_proj": self.reader.fields[f"{arch}.attention.head_count"].contents()}
        kv = self.reader.fields.get(f"{arch}.attention.head_count_kv")
        self.heads["k_proj"] = kv.contents() if kv is not None else self.heads["q_proj"]
        self.tensors = {}
        for t in self.reader.tensors:
            name = hf_name(t.name)
            if name is None:
                raise ValueError(f"{gguf_path.name}: tensor {t.name!r} has no place in a {arch} model")
            self.tensors[name] = t

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def __call__(self, name: str) -> Weight:
        t = self.tensors.get(name)
        if t is None:
            raise KeyError(f"GGUF file has no tensor for {name!r}")
        kind = t.tensor_type.name
        shape = tuple(int(n) for n in reversed(t.shape))
        if self.quantization is None and kind in KEPT and len(shape) == 2:
            w = decode(kind, np.asarray(t.data), shape)
        else:
            import gguf
            data = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
            w = torch.from_numpy(np.array(data, copy=True).reshape(shape))
        if self.permuted and name.endswith(("q_proj.weight", "k_proj.weight")):
            w = unpermute(w, self.heads[name.split(".")[-2]])
        if self.quantization in ("int8", "int4"):
            w = quantize_for(name, w, self.quantization)
        return w


def decode(kind: str, raw: np.ndarray, shape: tuple[int, int]) -> QuantizedWeight:
    """A quantized GGUF tensor's blocks (`raw`: [rows, bytes per row]) as codes, scales and zeros."""
    rows, cols = shape
    if kind == "Q8_0":  # per-32 scales do not fit a per-row kernel: requantize, one row at a time
        blocks = torch.from_numpy(np.array(raw, copy=True)).view(rows, cols // 32, 34)
        d = blocks[..., :2].contiguous().view(torch.float16).float()  # [rows, blocks, 1]
        q = blocks[..., 2:].contiguous().view(torch.int8).float()
        return quantize_int8((q * d).view(rows, cols))
    if kind == "Q4_K":
        return _decode_q4_k(raw, rows, cols)
    size = 18 if kind == "Q4_0" else 20
    blocks = torch.from_numpy(np.array(raw, copy=True)).view(rows, cols // 32, size)
    d = blocks[..., :2].contiguous().view(torch.float16).float()[..., 0]  # [rows, blocks]
    qs = blocks[..., size - 16:]
    codes = torch.cat([qs & 15, qs >> 4], dim=-1).reshape(rows, cols)  # low nibbles: inputs 0-15
    if kind == "Q4_0":  # w = d * (q - 8)
        zero = torch.zeros_like(d)
    else:  # Q4_1: w = d * q + m
        zero = blocks[..., 2:4].contiguous().view(torch.float16).float()[..., 0] + 8 * d
    return QuantizedWeight("int4", codes, d, zero, 32)


def _decode_q4_k(raw: np.ndarray, rows: int, cols: int) -> QuantizedWeight:
    """Q4_K: 256 inputs per block in 8 groups of 32, w = d * sc * q - dmin * m, with 6-bit sc and m."""
    blocks = torch.from_numpy(np.array(raw, copy=True)).view(rows, cols // 256, 144)
    d = blocks[..., 0:2].contiguous().view(torch.float16).float()  # [rows, blocks, 1]
    dmin = blocks[..., 2:4].contiguous().view(torch.float16).float()
    s = blocks[..., 4:16].to(torch.int32)
    lo, hi, mix = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = torch.cat([lo & 63, (mix & 15) | ((lo >> 2) & 48)], dim=-1)  # [rows, blocks, 8]
    mn = torch.cat([hi & 63, (mix >> 4) | ((hi >> 2) & 48)], dim=-1)
    qs = blocks[..., 16:].reshape(rows, cols // 256, 4, 32)  # 64 inputs per 32 bytes: low, then high
    codes = torch.stack([qs & 15, qs >> 4], dim=3).reshape(rows, cols)
    scale = (d * sc).reshape(rows, -1)
    zero = (8 * d * sc - dmin * mn).reshape(rows, -1)
    return QuantizedWeight("int4", codes, scale, zero, 32)


def unpermute(w: Weight, num_heads: int) -> Weight:
    """Undo llama.cpp's Q/K row order (each head's rotary halves interleaved)."""
    def rows(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(num_heads, t.shape[0] // num_heads // 2, 2, *t.shape[1:]).transpose(1, 2) \
            .reshape(t.shape)
    if isinstance(w, torch.Tensor):
        return rows(w)
    zeros = None if w.zeros is None else rows(w.zeros)
    return QuantizedWeight(w.format, rows(w.codes), rows(w.scales), zeros, w.group_size)
