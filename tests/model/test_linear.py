"""Linear: MKL-packed weights give a plain matmul's answer for every row count."""

from __future__ import annotations

import pytest
import torch
from helpers import CPU_FLAGS

from pdserve.model.linear import Linear, mkl_packing, onednn_bf16_packing


@pytest.mark.parametrize("rows", [1, 7, 32, 100, 2048])
@pytest.mark.parametrize("out_features, in_features", [(1024, 512), (512, 1408), (37, 20)])
def test_packed_matches_matmul(rows, out_features, in_features):
    g = torch.Generator().manual_seed(rows)
    weight = torch.randn(out_features, in_features, generator=g) / in_features ** 0.5
    x = torch.randn(rows, in_features, generator=g)
    lin = Linear(weight)
    # torch with MKL (every x86 build, this machine's included) must take the packed path
    assert lin.packed == mkl_packing() == torch.backends.mkl.is_available()
    torch.testing.assert_close(lin(x), x @ weight.t(), rtol=1e-5, atol=1e-5)


# what oneDNN's bfloat16 reorder asks of the CPU (its own error message names these); an AVX2-only CPU
# keeps the plain bfloat16 matmul
ONEDNN_BF16 = torch.backends.mkldnn.is_available() and (
    {"avx512bw", "avx512vl", "avx512dq"} <= CPU_FLAGS or "avx_ne_convert" in CPU_FLAGS
)


@pytest.mark.parametrize("rows", [1, 7, 32, 300])
def test_bfloat16_weights_are_packed_for_onednn(rows):
    g = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 64, generator=g).bfloat16()
    lin = Linear(weight)
    # where oneDNN can pack bfloat16 it must: the GEMV is twice as fast packed
    assert lin.packed == onednn_bf16_packing() == ONEDNN_BF16
    x = torch.randn(rows, 64, generator=g).bfloat16()
    torch.testing.assert_close(lin(x), x @ weight.t())


def test_unpacked_bfloat16_weights_warn_once_that_float32_is_faster(caplog):
    from pdserve.model import linear
    linear._warn_unpacked_bfloat16.cache_clear()
    with caplog.at_level("WARNING", logger="pdserve.model.linear"):
        Linear(torch.randn(32, 32).bfloat16())
        Linear(torch.randn(32, 32).bfloat16())
        Linear(torch.randn(32, 32))
    warnings = [r.getMessage() for r in caplog.records if "bfloat16 weights" in r.getMessage()]
    # where oneDNN packs bfloat16 the GEMM is fast and nothing is said; elsewhere once per process
    assert len(warnings) == (0 if ONEDNN_BF16 else 1)
    assert all("--quantization int8|int4" in w for w in warnings)
