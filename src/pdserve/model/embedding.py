"""The token embedding table, float or quantized; a lookup dequantizes only the rows it reads.

Every TP rank (each holds the whole table), once per step. A tied int8 table looks its rows up in
the LM head's packed weight (one copy of the codes); an int4 table keeps its own plain nibble
layout, since the int4 kernels' layouts interleave rows.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from pdserve.model.quant import Weight


class Embedding:
    def __init__(self, weight: Weight, dtype: torch.dtype,
                 shared_rows: Callable[[torch.Tensor], torch.Tensor] | None = None):
        """`shared_rows`: an int8 LM head's row lookup, used instead of keeping the codes twice."""
        self.dtype, self.shared_rows = dtype, shared_rows
        self.table = self.codes = self.scales = self.zeros = None
        if isinstance(weight, torch.Tensor):
            self.table = weight.to(dtype)
            return
        self.format, self.group_size = weight.format, weight.group_size
        self.scales, self.zeros = weight.scales, weight.zeros
        if weight.format == "int8":
            self.codes = None if shared_rows is not None else weight.codes
        else:  # two codes per byte: even inputs in the low nibble
            c = weight.codes
            self.codes = c[:, 0::2] | (c[:, 1::2] << 4)

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        """[tokens] -> [tokens, hidden] in the model's dtype."""
        if self.table is not None:
            return F.embedding(ids, self.table)
        codes = self.shared_rows(ids) if self.shared_rows is not None else self.codes[ids]
        if self.format == "int8":
            return (codes.float() * self.scales[ids, None]).to(self.dtype)
        q = torch.stack([codes & 15, codes >> 4], dim=-1).view(len(ids), -1).float()
        g = self.group_size
        scale = self.scales[ids].repeat_interleave(g, dim=1)
        zero = self.zeros[ids].repeat_interleave(g, dim=1)
        return ((q - 8) * scale + zero).to(self.dtype)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.table, self.codes, self.scales, self.zeros)
                   if t is not None)

