"""Weight-only quantized tensors, before packing: int8 per output channel, int4 in groups along the input.

Every TP rank, at load. A checkpoint's weight becomes a `QuantizedWeight` (quantized here from floats,
or decoded from a GGUF file's blocks without a float copy), is sliced and concatenated for tensor
parallelism like a plain tensor, and only then packed for torch's kernels (linear.py). Helpers at the
bottom take either kind, so the model code slices one way.
"""

from __future__ import annotations

import dataclasses

import torch

FORMATS = ("int8", "int4")
INT4_GROUP_SIZE = 32  # GGUF's block: Q4_0/Q4_1/Q4_K map onto it exactly; the finest torch's kernel takes


@dataclasses.dataclass
class QuantizedWeight:
    """int8: w = codes * scales[:, None]. int4: w = (codes - 8) * scale + zero per group of
    `group_size` inputs (the convention of torch's int4 kernel), codes in [0, 15]."""

    format: str
    codes: torch.Tensor  # [out, in]: int8 (int8) or uint8 (int4)
    scales: torch.Tensor  # float32: [out] (int8) or [out, in / group_size] (int4)
    zeros: torch.Tensor | None = None  # int4: float32 [out, in / group_size]
    group_size: int = 0

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    def rows(self, sl: slice) -> "QuantizedWeight":
        return dataclasses.replace(self, codes=self.codes[sl], scales=self.scales[sl],
                                   zeros=None if self.zeros is None else self.zeros[sl])

    def cols(self, sl: slice) -> "QuantizedWeight":
        """Input columns [start, stop): int8 keeps its per-row scales; int4 must cut between groups."""
        start, stop, _ = sl.indices(self.shape[1])
        if self.format == "int8":
            return dataclasses.replace(self, codes=self.codes[:, start:stop])
        g = self.group_size
        if start % g or stop % g:
            raise ValueError(f"int4 weight with groups of {g} cannot be split at columns {start}:{stop}")
        groups = slice(start // g, stop // g)
        return dataclasses.replace(self, codes=self.codes[:, start:stop], scales=self.scales[:, groups],
                                   zeros=self.zeros[:, groups])

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if self.format == "int8":
            return (self.codes.float() * self.scales[:, None]).to(dtype)
        g = self.group_size
        scale = self.scales.repeat_interleave(g, dim=1)
        zero = self.zeros.repeat_interleave(g, dim=1)
        return ((self.codes.float() - 8) * scale + zero).to(dtype)

    def nbytes(self) -> int:
        bits = 8 if self.format == "int8" else 4
        extra = [t for t in (self.scales, self.zeros) if t is not None]
        return self.codes.numel() * bits // 8 + sum(t.numel() * t.element_size() for t in extra)


def quantize_int8(w: torch.Tensor) -> QuantizedWeight:
    """Symmetric, one scale per output row (the row's largest magnitude maps to 127)."""
    w = w.float()
    scales = (w.abs().amax(dim=1) / 127).clamp(min=1e-12)
    codes = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return QuantizedWeight("int8", codes, scales)


def quantize_int4(w: torch.Tensor, group_size: int = INT4_GROUP_SIZE) -> QuantizedWeight:
    """Asymmetric per group of inputs: the group's min and max map to codes 0 and 15 (Q4_1's rule)."""
    out_features, in_features = w.shape
    if in_features % group_size:
        raise ValueError(f"int4 needs the input size ({in_features}) to be a multiple of {group_size}")
    wg = w.float().reshape(out_features, in_features // group_size, group_size)
    lo, hi = wg.amin(dim=-1), wg.amax(dim=-1)
    scales = ((hi - lo) / 15).clamp(min=1e-12)
    codes = torch.round((wg - lo[..., None]) / scales[..., None]).clamp(0, 15).to(torch.uint8)
    return QuantizedWeight("int4", codes.reshape(out_features, in_features), scales, lo + 8 * scales,
                           group_size)


def quantize(w: torch.Tensor, fmt: str) -> QuantizedWeight:
    """int4 falls back to int8 for a weight whose input size is not a multiple of the group."""
    if fmt == "int4" and w.shape[1] % INT4_GROUP_SIZE == 0:
        return quantize_int4(w)
    return quantize_int8(w)


def is_table(name: str) -> bool:
    """The embedding table or the LM head (tied or not)."""
    return name.endswith("embed_tokens.weight") or name == "lm_head.weight"


def quantize_for(name: str, w: "Weight", mode: str) -> "Weight":
    """A checkpoint weight under `--quantization int8|int4`: every matrix in that format, except that
    int4 keeps the embedding table and the LM head in int8 (as llama.cpp's Q4_K_M keeps its output
    layer at 6 bits: the logits are the most sensitive matrix, and one int8 table serves a tied
    embedding and head). Vectors (norms, biases) are left alone."""
    if isinstance(w, QuantizedWeight):
        w = w.dequantize()
    if w.dim() != 2:
        return w
    return quantize(w, "int8" if is_table(name) else mode)


Weight = torch.Tensor | QuantizedWeight


def rows(w: Weight, sl: slice) -> Weight:
    return w.rows(sl) if isinstance(w, QuantizedWeight) else w[sl]


def cols(w: Weight, sl: slice) -> Weight:
    return w.cols(sl) if isinstance(w, QuantizedWeight) else w[:, sl]


def cat_rows(parts: list[Weight]) -> Weight:
    """Stack weights along the output dim (q|k|v, gate|up). Mixed formats (a GGUF file may store
    q, k and v differently) are brought to the widest one: float, else int8, else int4."""
    if all(isinstance(p, torch.Tensor) for p in parts):
        return torch.cat(parts)
    if any(isinstance(p, torch.Tensor) for p in parts):
        dtype = next(p.dtype for p in parts if isinstance(p, torch.Tensor))
        return torch.cat([p.dequantize(dtype) if isinstance(p, QuantizedWeight) else p for p in parts])
    first = parts[0]
    if any(p.format != first.format or p.group_size != first.group_size for p in parts):
        return cat_rows([quantize_int8(p.dequantize()) for p in parts])
    zeros = None if first.zeros is None else torch.cat([p.zeros for p in parts])
    return dataclasses.replace(first, codes=torch.cat([p.codes for p in parts]),
                               scales=torch.cat([p.scales for p in parts]), zeros=zeros)


def pad_rows(w: Weight, num_rows: int) -> Weight:
    """Zero rows appended up to `num_rows` (the LM head's vocabulary shards gather evenly)."""
    extra = num_rows - w.shape[0]
    if extra <= 0:
        return w
    if isinstance(w, torch.Tensor):
        return torch.cat([w, w.new_zeros(extra, w.shape[1])])
    fill = 8 if w.format == "int4" else 0
    codes = torch.cat([w.codes, torch.full((extra, w.shape[1]), fill, dtype=w.codes.dtype)])
    scales = torch.cat([w.scales, w.scales.new_zeros(extra, *w.scales.shape[1:])])
    zeros = None if w.zeros is None else torch.cat([w.zeros, w.zeros.new_zeros(extra, w.zeros.shape[1])])
    return dataclasses.replace(w, codes=codes, scales=scales, zeros=zeros)


def cast(w: Weight, dtype: torch.dtype) -> Weight:
    return w if isinstance(w, QuantizedWeight) else w.to(dtype)
