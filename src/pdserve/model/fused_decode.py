"""A decode step's decoder layers in one native call (kernels/decoder_ops.c, `decode_layers`).

A TP size 1 model whose projections are all kernels/int4_linear.c ones (a quantized model where
that kernel builds), float32 activations, and a step of single-token decodes only: the common decode
step of a quantized model on one CPU, with a float32, bfloat16 or fp8 KV cache. Anything else
(prefills, TP > 1, QK norms, float weights) takes llama.py's layer-by-layer path. The C loop calls
the same kernels in the same order on the same values, so the hidden states are bit for bit the
same (tests/model/test_fused_decode.py). What it removes is Python: SmolLM2-135M int4 at batch 1
made ~270 calls a step from Python, each with its tensor bookkeeping, ~3 ms of an ~11 ms step
beyond its kernels.
"""

from __future__ import annotations

import ctypes

import torch

from pdserve.model import kernels
from pdserve.model.attention import AttentionMetadata, native_decode
from pdserve.model.fused import KV_KINDS, _lib, scales_native
from pdserve.model.linear import Int4Linear, Int8Linear, _int4_lib_for


_p, _i, _f = ctypes.c_void_p, ctypes.c_int, ctypes.c_float


class _Linear(ctypes.Structure):
    _fields_ = [("fn", _p), ("w", _p), ("scales", _p), ("k", _i), ("n", _i)]


class _Layer(ctypes.Structure):
    _fields_ = [("qkv", _Linear), ("o", _Linear), ("gate_up", _Linear), ("down", _Linear),
                ("qkv_bias", _p), ("input_norm", _p), ("post_attn_norm", _p), ("k_cache", _p),
                ("v_cache", _p), ("k_scales", _p), ("v_scales", _p)]


class _Model(ctypes.Structure):
    _fields_ = [("num_layers", _i), ("hidden", _i), ("heads", _i), ("kv_heads", _i), ("head_dim", _i),
                ("inter", _i), ("block_size", _i), ("kv_kind", _i), ("eps", _f), ("scale", _f),
                ("cos", _p), ("sin", _p), ("final_norm", _p), ("attend", _p), ("layers", _p)]


class _Step(ctypes.Structure):
    _fields_ = [("rows", _i), ("max_blocks", _i), ("window", _i), ("positions", _p), ("slot_blocks", _p),
                ("slot_offsets", _p), ("tables", _p), ("context_lens", _p), ("h", _p), ("qkv", _p),
                ("q", _p), ("attn", _p), ("delta", _p), ("gate_up", _p), ("act", _p), ("xq", _p),
                ("dx", _p), ("t", _p)]


def _linear(layer: Int4Linear | Int8Linear, lib: ctypes.CDLL) -> _Linear | None:
    """The C view of a projection, None when the C loop cannot run it (torch's kernel, or padded
    output rows the next op would read as values)."""
    if not isinstance(layer, (Int4Linear, Int8Linear)) or not layer.native:
        return None
    if isinstance(layer, Int4Linear):
        fn, w, scales = lib.int4_linear, layer.codes, layer.scales
    else:
        fn, w, scales = lib.int8_linear, layer.blocks, layer.row_scales
    if w.shape[0] * 16 != layer.out_features:
        return None
    return _Linear(ctypes.cast(fn, _p).value, w.data_ptr(), scales.data_ptr(), layer.in_features,
                   layer.out_features)


class FusedDecode:
    """`decode_layers` for one model (a CausalLM, typed as a Module so this file need not import
    llama): its weights' addresses gathered once, the KV caches' once per cache set, scratch grown
    to the largest batch seen."""

    def __init__(self, model: torch.nn.Module, ops: ctypes.CDLL, layers: list[tuple[_Linear, ...]]):
        spec, first = model.spec, model.layers[0]
        self.model, self.ops, self.linears = model, ops, layers
        self.widths = {"h": spec.hidden_size, "qkv": layers[0][0].n, "q": first.num_heads * spec.head_dim,
                       "attn": first.num_heads * spec.head_dim, "delta": spec.hidden_size,
                       "gate_up": layers[0][2].n, "act": layers[0][2].n // 2}
        self.max_in = max(lin.k for lins in layers for lin in lins)
        self._caches: tuple[tuple[int, ...], torch.dtype, _Model, ctypes.Array] | None = None
        self._scratch: dict[str, torch.Tensor] = {}

    @classmethod
    def build(cls, model: torch.nn.Module) -> FusedDecode | None:
        """The fused path for `model`, or None when some part of it needs the Python one."""
        if model.tp.size != 1 or model.dtype is not torch.float32 or model.spec.qk_norm:
            return None
        ops, lin_lib = _lib(kernels.MARCH), _int4_lib_for(kernels.MARCH)
        if ops is None or lin_lib is None:
            return None
        layers = []
        for layer in model.layers:
            lins = tuple(_linear(getattr(layer, name), lin_lib)
                         for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"))
            if any(lin is None for lin in lins):
                return None
            layers.append(lins)
        shapes = {tuple((lin.k, lin.n) for lin in lins) for lins in layers}
        if len(shapes) != 1:  # one scratch layout serves every layer
            return None
        ops.decode_layers.argtypes = [ctypes.POINTER(_Model), ctypes.POINTER(_Step), _p, _p, _i]
        ops.decode_layers.restype = None
        return cls(model, ops, layers)

    def takes(self, x: torch.Tensor, kv_caches: list[tuple[torch.Tensor, ...]], meta: AttentionMetadata) -> bool:
        """Whether this step can run here: single-token decodes only, a cache the C ops store to."""
        if meta.prefills or meta.decode_start != 0 or meta.decode_block_tables is None:
            return False
        k_cache, _, *scales = kv_caches[0]
        return (k_cache.dtype in KV_KINDS and scales_native(k_cache, tuple(scales) or None)
                and x.is_contiguous() and native_decode(k_cache.dtype) is not None)

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, kv_caches: list[tuple[torch.Tensor, ...]],
                 meta: AttentionMetadata) -> torch.Tensor:
        """x: the embeddings [rows, hidden] (the residual stream, updated in place) -> the final
        norm's output [rows, hidden], as CausalLM.forward returns it."""
        model = self._model_struct(kv_caches)
        rows = x.shape[0]
        scratch = self._scratch_for(rows)
        tables, lens = meta.decode_block_tables, meta.decode_context_lens
        step = _Step(rows, tables.shape[1], meta.sliding_window or 0, positions.data_ptr(),
                     meta.slot_blocks.data_ptr(), meta.slot_offsets.data_ptr(), tables.data_ptr(),
                     lens.data_ptr(), *(scratch[name].data_ptr() for name in (*self.widths, "xq", "dx", "t")))
        out = torch.empty_like(x)
        self.ops.decode_layers(ctypes.byref(model), ctypes.byref(step), x.data_ptr(), out.data_ptr(),
                               torch.get_num_threads())
        return out

    def _model_struct(self, kv_caches: list[tuple[torch.Tensor, ...]]) -> _Model:
        key = tuple(t.data_ptr() for pair in kv_caches for t in pair)
        if self._caches is None or self._caches[0] != key:
            m, spec, dtype = self.model, self.model.spec, kv_caches[0][0].dtype
            layers = (_Layer * len(m.layers))()
            for entry, layer, lins, (k_cache, v_cache, *scales) in zip(layers, m.layers, self.linears, kv_caches):
                bias = layer.qkv_bias.data_ptr() if layer.qkv_bias is not None else None
                entry.qkv, entry.o, entry.gate_up, entry.down = lins
                entry.qkv_bias, entry.input_norm = bias, layer.input_norm.data_ptr()
                entry.post_attn_norm = layer.post_attn_norm.data_ptr()
                entry.k_cache, entry.v_cache = k_cache.data_ptr(), v_cache.data_ptr()
                if scales:
                    entry.k_scales, entry.v_scales = scales[0].data_ptr(), scales[1].data_ptr()
            first = m.layers[0]
            struct = _Model(len(m.layers), spec.hidden_size, first.num_heads, first.num_kv_heads,
                            spec.head_dim, self.widths["act"], kv_caches[0][0].shape[2],
                            KV_KINDS[dtype], spec.rms_norm_eps, spec.head_dim ** -0.5,
                            m.rope.cos.data_ptr(), m.rope.sin.data_ptr(), m.norm.data_ptr(),
                            ctypes.cast(native_decode(dtype).fn, _p).value, ctypes.addressof(layers))
            self._caches = (key, dtype, struct, layers)  # the array lives as long as the struct uses it
        return self._caches[2]

    def _scratch_for(self, rows: int) -> dict[str, torch.Tensor]:
        """Buffers for at least `rows` rows (each row at its width's stride, so larger ones serve)."""
        held = self._scratch.get("h")
        if held is None or held.shape[0] < rows:
            groups = self.max_in // 32
            self._scratch = {name: torch.empty(rows, width) for name, width in self.widths.items()}
            self._scratch.update(xq=torch.empty(rows, self.max_in, dtype=torch.int8),
                                 dx=torch.empty(rows, groups), t=torch.empty(rows, groups))
        return self._scratch
