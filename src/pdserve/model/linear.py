"""A projection with a fixed weight, y = x W^T, stored the way the CPU's fastest GEMM wants it.

Every TP rank, for every projection of every layer and the LM head. On torch builds with MKL (x86),
the weight is packed once into MKL's GEMM format and each call runs cblas_sgemm_compute on it: with
a plain `x @ w` MKL re-packs the weight on every call, which `perf` showed as 21 % of a batch-32
decode step's CPU time. Packed for 128 rows, decode ran 9 % faster at batch 32 and 23 % at batch 8,
batch 1 and prefills of 128 to 2,048 tokens within the noise (+-5 %) or faster, at 1 and 2 threads
(`small` model, both paths alternating in one process; packed for 32 rows, prefill of 128 tokens
on one thread was 30 % slower). A bfloat16 weight is packed the same way for oneDNN
(`mkldnn._reorder_linear_weight`, `_linear_pointwise`): a plain bfloat16 `x @ w` ran SmolLM2's 120
projections in 25 ms at one row, slower than float32's 22 ms; packed, in 11 ms (and 24 ms at 32
rows against 38 ms). Elsewhere (no MKL or oneDNN) the weight
is a contiguous [in, out] tensor on huge pages, which `x @ w` reads faster than the [out, in]
layout of `F.linear` (12.1 vs 15.8 ms for 8 small-model layers at 32 rows).

Quantized weights (quant.py) run on torch's own CPU kernels, `_weight_int8pack_mm` and
`_weight_int4pack_mm_for_cpu`, with bfloat16 activations: with float32 ones this torch takes a
slow path, 4x (int8) and 8x (int4) slower than float32's MKL GEMM at one row and 30x and 59x at 32,
while with bfloat16 they beat it 2.7x and 4.4x at one row, 1.9x and 2.2x at 32
(bench/quant_kernels.py).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import threading

import torch

from pdserve.model import kernels
from pdserve.model.host_memory import huge_page_copy
from pdserve.model.quant import QuantizedWeight, Weight, pad_rows

logger = logging.getLogger(__name__)
_PACK_ROWS = 128  # MKL tunes its packing for this many rows; every row count computes correctly


@functools.lru_cache(maxsize=1)
def mkl_packing() -> bool:
    """True when this torch has MKL's packed GEMM and it computes a row count other than the one it
    was packed for, given only the weight's shape, as a plain matmul does (checked once, on a small
    matrix)."""
    try:
        if not torch.backends.mkl.is_available():
            return False
        g = torch.Generator().manual_seed(0)
        w, x = torch.randn(48, 40, generator=g), torch.randn(5, 40, generator=g)
        packed = torch.ops.mkl._mkl_reorder_linear_weight(w, _PACK_ROWS)
        y = torch.ops.mkl._mkl_linear(x, packed, _shape_only(w), None, x.shape[0])
        return bool(torch.allclose(y, x @ w.t(), rtol=1e-5, atol=1e-5))
    except (AttributeError, RuntimeError):
        return False


@functools.lru_cache(maxsize=1)
def onednn_bf16_packing() -> bool:
    """True when oneDNN packs a bfloat16 weight and its product matches a plain matmul at a row
    count other than the one it was packed for (checked once, on a small matrix)."""
    try:
        g = torch.Generator().manual_seed(0)
        w = torch.randn(48, 40, generator=g).bfloat16()
        x = torch.randn(5, 40, generator=g).bfloat16()
        packed = torch.ops.mkldnn._reorder_linear_weight(w, _PACK_ROWS)
        y = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        return bool(torch.allclose(y.float(), (x @ w.t()).float(), rtol=1e-2, atol=1e-2))
    except (AttributeError, RuntimeError):
        return False


@functools.lru_cache(maxsize=1)
def _warn_unpacked_bfloat16() -> None:
    """Once per process: without oneDNN's bfloat16 packing (no AVX512-BF16 or AVX-NE-CONVERT), a
    bfloat16 GEMM here ran SmolLM2's projections 6x slower than float32 at one row and 42x at 32
    (bench/results/quant_kernels_avx2.json)."""
    logger.warning("bfloat16 weights on a CPU without native bfloat16 GEMMs run several times slower "
                   "than float32; --dtype float32, or --quantization int8|int4 for fewer bytes, is faster here")


def _shape_only(weight: torch.Tensor) -> torch.Tensor:
    """A stand-in for the dense weight `_mkl_linear` also takes: it reads only its shape when the
    row count it is given matches the input's, which every call here guarantees (the self-check
    above runs this way too), so no second copy of the weight is kept."""
    return torch.empty(1, dtype=weight.dtype).expand(weight.shape)


class Linear:
    def __init__(self, weight: torch.Tensor):
        """weight: [out, in], as checkpoints store it."""
        self.out_features, self.in_features = weight.shape
        self._packed = self._shape = self._dense = self._onednn = None
        if weight.dtype == torch.float32 and weight.device.type == "cpu" and mkl_packing():
            self._packed = torch.ops.mkl._mkl_reorder_linear_weight(weight.contiguous(), _PACK_ROWS)
            self._shape = _shape_only(weight)
        elif weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and onednn_bf16_packing():
            self._onednn = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), _PACK_ROWS)
        else:
            if weight.dtype == torch.bfloat16:
                _warn_unpacked_bfloat16()
            self._dense = huge_page_copy(weight.t())

    @property
    def packed(self) -> bool:
        return self._packed is not None or self._onednn is not None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: [rows, in] -> [rows, out]."""
        if self._packed is not None:
            return torch.ops.mkl._mkl_linear(x, self._packed, self._shape, None, x.shape[0])
        if self._onednn is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self._onednn, None, "none", [], "")
        return x @ self._dense


_COMPUTE = torch.bfloat16  # the activations torch's int8/int4 CPU kernels are vectorized for
_INT8_K_MULTIPLE = 32  # torch 2.13's int8 kernel reads past rows (or crashes) for other input sizes
_INT4_N_MULTIPLE = 16  # its int4 packing needs output rows in sixteens


class Int8Linear:
    """Per-output-channel int8 weight, one scale per row. Where kernels/int4_linear.c builds, in its
    layout (16 rows per vector lane, codes plus 128); elsewhere [out, in] codes as stored, for
    torch's `_weight_int8pack_mm`. A tied int8 embedding looks its rows up here (`row_codes`)."""

    def __init__(self, weight: QuantizedWeight):
        self.out_features, self.in_features = weight.shape
        self.native = _int4_lib() is not None
        if self.native:
            self.blocks, self.row_scales = _pack_int8_rows(pad_rows(weight, -(-self.out_features // 16) * 16))
        else:
            self.codes = huge_page_copy(weight.codes)
            self.scales = weight.scales.to(_COMPUTE)

    def row_codes(self, ids: torch.Tensor) -> torch.Tensor:
        """The int8 codes of output rows `ids`, [len(ids), in] (a tied embedding's lookup)."""
        if not self.native:
            return self.codes[ids]
        groups = self.in_features // 32
        planes = self.blocks.view(-1, groups, 8, 16, 4)  # [blocks, group, plane, row, byte]
        rows = planes[ids // 16, :, :, ids % 16, :]  # [ids, group, plane, byte]
        return (rows.reshape(len(ids), -1).to(torch.int16) - 128).to(torch.int8)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.native:
            return _run_native(_int4_lib().int8_linear, x, self.blocks, self.row_scales,
                               self.in_features, self.out_features)
        y = torch.ops.aten._weight_int8pack_mm(x.to(_COMPUTE), self.codes, self.scales)
        return y.to(x.dtype)


def _int4_lib() -> ctypes.CDLL | None:
    """kernels/int4_linear.c, where this CPU has AVX2, FMA and F16C (its AVX512-VNNI build where it has
    that too), else None: torch's kernel. Both builds read one layout."""
    return _int4_lib_for(kernels.MARCH)


@functools.lru_cache(maxsize=None)
def _int4_lib_for(march: str) -> ctypes.CDLL | None:
    lib = kernels.load("int4_linear", cpu_flags=("avx2", "fma", "f16c"), march=march)
    if lib is not None:
        p, i = ctypes.c_void_p, ctypes.c_int
        for fn in (lib.int4_linear, lib.int8_linear):
            fn.argtypes = [p, i, i, p, p, i, p, p, p, p, i]
            fn.restype = None
    return lib


class Int4Linear:
    """Grouped int4 weight (groups of 32 inputs). Where kernels/int4_linear.c builds (AVX2 or
    AVX512-VNNI), in its layout. SmolLM2's projections (bench/quant_kernels.py), against torch's
    kernel: with VNNI 4.0 ms against 4.6 at one row and 19.8 against 45.9 at 32 (int8: 5.0 against
    8.1, 21.1 against 50.2); on AVX2 alone 4.6 against 16.6 and 51 against 167 (int8: 7.8 against
    21.1, 66 against 168). Elsewhere packed by `_convert_weight_to_int4pack_for_cpu`, with its
    scales and zeros as that kernel wants them ([in / group, out, 2])."""

    def __init__(self, weight: QuantizedWeight):
        self.out_features, self.in_features = weight.shape
        self.group_size = weight.group_size
        rows = -(-self.out_features // _INT4_N_MULTIPLE) * _INT4_N_MULTIPLE
        if rows != self.out_features:
            weight = pad_rows(weight, rows)
        self.native = weight.group_size == 32 and _int4_lib() is not None
        if self.native:
            self.codes, self.scales = _pack_rows(weight)
            return
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(weight.codes.to(torch.int32), 1)
        self.scales_zeros = torch.stack([weight.scales.t(), weight.zeros.t()], dim=-1).to(_COMPUTE).contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.native:
            return _run_native(_int4_lib().int4_linear, x, self.codes, self.scales, self.in_features,
                               self.out_features)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(_COMPUTE), self.packed, self.group_size,
                                                      self.scales_zeros)
        if y.shape[1] != self.out_features:
            y = y[:, : self.out_features]
        return y.to(x.dtype)


def _run_native(fn, x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, in_features: int,
                out_features: int) -> torch.Tensor:
    """One call of a kernels/int4_linear.c function: x [rows, in] -> [rows, out] in x's dtype. The
    quantized activations go to this thread's scratch (`_scratch`): a decode step makes ~120 calls, and
    allocating their buffers each time cost about a tenth of a one-stream SmolLM2 step."""
    x32 = x if x.dtype == torch.float32 and x.is_contiguous() else x.float().contiguous()
    rows, n = x.shape[0], codes.shape[0] * 16
    y = torch.empty(rows, n)
    xq, dx, t = _scratch(rows, in_features)
    fn(x32.data_ptr(), rows, in_features, codes.data_ptr(), scales.data_ptr(), n, y.data_ptr(), xq, dx, t,
       torch.get_num_threads())
    if n != out_features:
        y = y[:, :out_features]
    return y if y.dtype == x.dtype else y.to(x.dtype)


_local = threading.local()  # TP ranks may be threads of one process: each has its own scratch


def _scratch(rows: int, in_features: int) -> tuple[int, int, int]:
    """Addresses of this thread's buffers for `rows` activation rows of `in_features`: int8 codes
    [rows, in], then their scales and sums [rows, in / 32] each (the kernel reads them at these row
    strides, so a larger buffer serves fewer rows). Grown, never shrunk: one per input size."""
    buffers = _local.__dict__.setdefault("buffers", {})
    held = buffers.get(in_features)
    if held is None or held[0] < rows:
        groups = in_features // 32
        codes, floats = torch.empty(rows, in_features, dtype=torch.int8), torch.empty(2, rows, groups)
        held = buffers[in_features] = (rows, codes, floats, codes.data_ptr(), floats.data_ptr(),
                                       floats.data_ptr() + rows * groups * floats.element_size())
    return held[3:]


def _pack_int8_rows(weight: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """kernels/int4_linear.c's int8 layout: per 16 output rows and group of 32 inputs, 8 planes of
    64 bytes whose byte 4j+b is row j's code plus 128 for input 4i+b. ([out / 16, groups * 512], [out])"""
    n, k = weight.shape
    blocks, groups = n // 16, k // 32
    shifted = (weight.codes.to(torch.int16) + 128).to(torch.uint8)
    planes = shifted.view(blocks, 16, groups, 8, 4).permute(0, 2, 3, 1, 4).reshape(blocks, groups * 512)
    return huge_page_copy(planes), weight.scales.float().contiguous()


def _pack_rows(weight: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """kernels/int4_linear.c's layout: per 16 output rows and group, 4 x 64 bytes whose nibble
    plane i holds, at byte 4j+b, row j's code for input 4i+b; and per group the rows' scales and
    zeros minus 8 * scales in float16. Returns ([out / 16, groups * 256] uint8, [out / 16, groups * 32])."""
    n, k = weight.shape
    blocks, groups = n // 16, k // 32
    planes = weight.codes.view(blocks, 16, groups, 8, 4).permute(0, 2, 3, 1, 4).reshape(blocks, groups, 8, 64)
    codes = (planes[:, :, 0::2] | (planes[:, :, 1::2] << 4)).reshape(blocks, groups * 256)
    scales = weight.scales.view(blocks, 16, groups).permute(0, 2, 1)
    zeros = (weight.zeros - 8 * weight.scales).view(blocks, 16, groups).permute(0, 2, 1)
    packed = torch.stack([scales, zeros], dim=2).to(torch.float16).reshape(blocks, groups * 32)
    return huge_page_copy(codes), packed.contiguous()


def make_linear(weight: Weight, dtype: torch.dtype) -> Linear | Int8Linear | Int4Linear:
    """The layer for a weight as loaded: a float tensor (cast to `dtype`) or a quantized one. A
    quantized weight the kernels cannot take (input size not a multiple of 32) runs dense."""
    if isinstance(weight, torch.Tensor):
        return Linear(weight.to(dtype))
    if weight.shape[1] % _INT8_K_MULTIPLE:
        return Linear(weight.dequantize(dtype))
    return Int8Linear(weight) if weight.format == "int8" else Int4Linear(weight)


def weight_bytes(layer) -> int:
    """Bytes the layer's weights occupy (what one decode step reads). A packed float layer counts
    its weight's own size: MKL's and oneDNN's packed buffers are opaque (and sized for the worst
    case, 2-7x, but only the weight's pages are ever touched)."""
    if isinstance(layer, Linear):
        dtype = torch.float32 if layer._packed is not None else (
            layer._onednn.dtype if layer._onednn is not None else layer._dense.dtype)
        return layer.out_features * layer.in_features * torch.empty(0, dtype=dtype).element_size()
    return sum(t.numel() * t.element_size() for t in vars(layer).values() if isinstance(t, torch.Tensor))
