"""What the KV cache dtype buys: decode step time at a 2,048-token context and the bytes one P/D
READ of that context moves, per `--kv-cache-dtype`, on the generated `small` model.

    .venv/bin/python bench/kv_dtype.py [--model DIR] [--threads 1] [--quantization none|int8|int4]
                                       [--out bench/results/kv_dtype.json]

Decode: batch 1, 8 and 32, 2,048-token prompts, 32 new tokens, prefill excluded, best of two runs per
dtype, alternating. Bytes: a 2,048-token READ as the connector posts it (every region of the prompt's
blocks, fp8's scale regions included; tests/kv_transfer/test_kv_dtypes.py and tests/pd/test_pd_kv_dtype.py
check the same count through the loopback fabric and NIXL). With `--quantization int8` or `int4` the
weights a step reads shrink, so the KV's share of a step, and what its dtype buys, grows.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine import pdserve_decode  # noqa: E402

from pdserve import LLM  # noqa: E402
from pdserve.bench.machine import busy_cores  # noqa: E402
from pdserve.cli import ensure_model  # noqa: E402
from pdserve.model.spec import ModelSpec  # noqa: E402
from pdserve.worker.kv_cache import CacheLayout  # noqa: E402

DTYPES = ("float32", "bfloat16", "fp8_e4m3")
CONTEXT, NEW_TOKENS, BATCHES, BLOCK = 2048, 32, (1, 8, 32), 16


def read_bytes(spec: ModelSpec, name: str, tokens: int = CONTEXT) -> int:
    layout = CacheLayout.for_dtype(spec.num_layers, 1, spec.num_kv_heads, BLOCK, spec.head_dim, name)
    return layout.num_regions * (tokens // BLOCK) * (layout.block_bytes + layout.scale_block_bytes)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quantization", default="none", choices=("none", "int8", "int4"))
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "kv_dtype.json"))
    args = parser.parse_args()
    model = ensure_model(args.model, "small")
    spec = ModelSpec.from_dir(model)
    torch.set_num_threads(args.threads)
    results = {"model": model, "threads": args.threads, "quantization": args.quantization,
               "busy_cores_before": busy_cores(), "cpu": torch.backends.cpu.get_cpu_capability(),
               "context": CONTEXT, "new_tokens": NEW_TOKENS, "dtypes": {}}
    llms = {d: LLM(model, num_threads=args.threads, num_blocks=max(BATCHES) * (CONTEXT + NEW_TOKENS) // BLOCK + 16,
                   max_num_seqs=max(BATCHES), max_num_batched_tokens=CONTEXT, kv_cache_dtype=d,
                   quantization=args.quantization) for d in DTYPES}
    try:
        for d, llm in llms.items():
            pdserve_decode(llm, 1, spec.vocab_size, 16, 4)  # warm-up
            results["dtypes"][d] = {"read_bytes": read_bytes(spec, d), "decode": {}}
        for batch in BATCHES:
            best = {d: 0.0 for d in DTYPES}
            for _ in range(2):  # alternating: the machine is shared and noisy
                for d, llm in llms.items():
                    best[d] = max(best[d], pdserve_decode(llm, batch, spec.vocab_size, CONTEXT, NEW_TOKENS))
            for d in DTYPES:
                results["dtypes"][d]["decode"][batch] = {"tok_s": round(best[d], 1),
                                                         "step_ms": round(1e3 * batch / best[d], 2)}
    finally:
        for llm in llms.values():
            llm.shutdown()
    base = results["dtypes"]["float32"]
    print(f"small model, weights {args.quantization}, {args.threads} thread(s), {CONTEXT}-token context, "
          f"{NEW_TOKENS} new tokens")
    print("kv dtype  | READ bytes (vs float32) | " + " | ".join(f"batch {b} step ms (speedup)" for b in BATCHES))
    for d, r in results["dtypes"].items():
        cells = [f"{r['decode'][b]['step_ms']:8.2f} ({base['decode'][b]['step_ms'] / r['decode'][b]['step_ms']:.2f}x)"
                 for b in BATCHES]
        print(f"{d:9} | {r['read_bytes']:12,} ({r['read_bytes'] / base['read_bytes']:.3f}) | " + " | ".join(cells))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
