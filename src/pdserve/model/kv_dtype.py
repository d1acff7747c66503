"""KV cache dtypes in vLLM's spelling (`--kv-cache-dtype`), and the codec between a cache's stored
form and the compute dtype.

Runs in every TP rank: attention writes this step's K/V through `write_kv` and reads blocks back
through `dequantize`; a consumer rank converts blocks it READ from a producer of another float
KV dtype (kv_transfer/staging.py). fp8_e4m3 stores one float32 scale per (block, head, slot) beside
the blocks (docs/design.md, "KV cache dtype"): a slot is quantized once, when its token is written, and never
rescaled, so a block filling up token by token never re-rounds what it already holds.
"""

from __future__ import annotations

import torch

FP8 = "fp8_e4m3"
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", FP8)
ALIASES = {"fp8": FP8}  # vLLM's `fp8` is e4m3 on CPUs and most GPUs
FP8_MAX = 448.0  # largest finite float8_e4m3fn
SCALE_DTYPE = torch.float32
_TORCH = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          FP8: torch.float8_e4m3fn}
_FLOAT = ("float32", "bfloat16", "float16")  # converted into one another on arrival


class KVDtypeError(ValueError):
    pass


def resolve(kv_cache_dtype: str, model_dtype: torch.dtype) -> str:
    """The stored dtype's name: `auto` is the model's dtype."""
    name = ALIASES.get(kv_cache_dtype, kv_cache_dtype)
    if name not in KV_CACHE_DTYPES:
        raise KVDtypeError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
    return str(model_dtype).removeprefix("torch.") if name == "auto" else name


def torch_dtype(name: str) -> torch.dtype:
    return _TORCH[name]


def element_bytes(name: str) -> int:
    return torch.empty(0, dtype=_TORCH[name]).element_size()


def scale_bytes(name: str) -> int:
    """Bytes of the scale stored per (block, head, slot): 0 for the float dtypes."""
    return SCALE_DTYPE.itemsize if name == FP8 else 0


def convertible(producer: str, consumer: str) -> bool:
    """A consumer storing `consumer` can take a READ of blocks stored as `producer`."""
    return producer == consumer or (producer in _FLOAT and consumer in _FLOAT)


def incompatible(producer: str, consumer: str) -> str:
    return (f"KV cache dtypes differ: the producer stores {producer}, this instance {consumer}, and "
            f"pdserve converts only between {', '.join(_FLOAT)} (start both with the same "
            "--kv-cache-dtype)")


# --- fp8 -------------------------------------------------------------------------------------------

def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., head_dim] -> (fp8 codes [..., head_dim], float32 scales [...]): one scale per row,
    its absolute maximum over FP8_MAX (a row of zeros gets scale 1)."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    codes = (xf / scale[..., None]).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return codes, scale


def dequantize(codes: torch.Tensor, scales: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Stored rows [..., head_dim] (and their scales [...], fp8 only) -> `dtype`."""
    if scales is None:
        return codes if codes.dtype == dtype else codes.to(dtype)
    return (codes.float() * scales[..., None]).to(dtype)


# --- cache writes -----------------------------------------------------------------------------------

def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_blocks: torch.Tensor, slot_offsets: torch.Tensor,
             scales: tuple[torch.Tensor, torch.Tensor] | None) -> None:
    """Store k, v [tokens, kv_heads, head_dim] in their slots of caches [blocks, kv_heads, block_size,
    head_dim], in the caches' dtype; `scales` ([blocks, kv_heads, block_size] each) for fp8."""
    for cache, x, scale in ((k_cache, k, scales and scales[0]), (v_cache, v, scales and scales[1])):
        if scale is None:
            cache[slot_blocks, :, slot_offsets] = x.to(cache.dtype)
        else:
            codes, s = quantize(x)
            cache[slot_blocks, :, slot_offsets] = codes
            scale[slot_blocks, :, slot_offsets] = s

