"""torch's weight-only int8/int4 CPU kernels against the float32 and bfloat16 GEMMs pdserve uses, on
SmolLM2-135M's 120 projection shapes (30 layers of qkv, o, gate|up, down), one thread.

    .venv/bin/python bench/quant_kernels.py [--out bench/results/quant_kernels.json] [--march haswell]

Milliseconds for all 120 at 1 and 32 rows, best of 3: what chose bfloat16 activations for torch's
kernels and pdserve's own int8/int4 kernels over torch's (model/linear.py). Random weights; the kernels'
speed does not depend on values.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from pdserve.model import kernels  # noqa: E402
from pdserve.model.linear import Linear, make_linear  # noqa: E402
from pdserve.model.quant import quantize_int4, quantize_int8  # noqa: E402

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30  # [out, in]


def run(layers, inputs) -> None:
    for layer, x in zip(layers, inputs):
        layer(x)


def best_ms(fn, repeats: int = 3) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return round(min(times) * 1e3, 2)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "quant_kernels.json"))
    parser.add_argument("--march", default="native",
                        help="build pdserve's kernels for this CPU (haswell: the AVX2 build, measurable on an AVX-512 CPU)")
    args = parser.parse_args()
    kernels.MARCH = args.march
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=g) / k ** 0.5 for n, k in SHAPES]
    int8 = [quantize_int8(w) for w in weights]
    int4 = [quantize_int4(w) for w in weights]
    packed4 = [torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.codes.int(), 1) for q in int4]
    sz = [torch.stack([q.scales.t(), q.zeros.t()], -1).contiguous() for q in int4]
    layers = {"float32 (MKL packed)": [Linear(w) for w in weights],
              "bfloat16 (oneDNN packed)": [Linear(w.bfloat16()) for w in weights],
              "int8, pdserve's kernel (int8 activations)": [make_linear(q, torch.float32) for q in int8],
              "int4, pdserve's kernel (int8 activations)": [make_linear(q, torch.float32) for q in int4]}
    results = {"threads": 1, "layers": len(SHAPES), "march": args.march, "ms": {}}
    for rows in (1, 32):
        xs = {k: torch.randn(rows, k, generator=g) for k in (576, 1536)}
        row = results["ms"][rows] = {}
        for name, lins in layers.items():
            dtype = torch.bfloat16 if name.startswith("bfloat16") else torch.float32
            row[name] = best_ms(functools.partial(run, lins, [xs[w.shape[1]].to(dtype) for w in weights]))
        inputs = [xs[w.shape[1]] for w in weights]  # the kernels straight, float32 activations
        int8_f32 = [functools.partial(torch.ops.aten._weight_int8pack_mm, mat2=q.codes, scales=q.scales)
                    for q in int8]
        int4_f32 = [functools.partial(torch.ops.aten._weight_int4pack_mm_for_cpu, mat2=p, qGroupSize=32,
                                      qScaleAndZeros=s) for p, s in zip(packed4, sz)]
        sz16 = [x.to(torch.bfloat16) for x in sz]
        int4_bf16 = [functools.partial(torch.ops.aten._weight_int4pack_mm_for_cpu, mat2=p, qGroupSize=32,
                                       qScaleAndZeros=s) for p, s in zip(packed4, sz16)]
        row["int4, torch's kernel, bfloat16 activations"] = best_ms(functools.partial(
            run, int4_bf16, [x.to(torch.bfloat16) for x in inputs]))
        int8_bf16 = [functools.partial(torch.ops.aten._weight_int8pack_mm, mat2=q.codes,
                                       scales=q.scales.to(torch.bfloat16)) for q in int8]
        row["int8, torch's kernel, bfloat16 activations"] = best_ms(functools.partial(
            run, int8_bf16, [x.to(torch.bfloat16) for x in inputs]))
        row["int8, float32 activations"] = best_ms(functools.partial(run, int8_f32, inputs), 1)
        row["int4, float32 activations"] = best_ms(functools.partial(run, int4_f32, inputs), 1)
        print(rows, json.dumps(row), flush=True)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
