"""What content hashing costs a request: the block hashes of a 2,000-token prompt at block size 16
(125 blocks), computed once per request (then extended one block at a time as it generates).

    .venv/bin/python bench/block_hashing.py [--iterations 2000]

Median of 5 runs. Beside it, the Python `hash()` chain the pool used before (not stable across
processes). Target: under 0.5 ms per prompt (its prefill takes about a second on one CPU core).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from signing import per_op_us  # noqa: E402

from pdserve.prefix_cache.hashing import extra_keys, hash_blocks  # noqa: E402

PROMPT_TOKENS, BLOCK_SIZE = 2000, 16


def python_hash_chain(tokens: list[int]) -> list[int]:
    out, parent = [], None
    for i in range(0, len(tokens) - BLOCK_SIZE + 1, BLOCK_SIZE):
        parent = hash((parent, tuple(tokens[i:i + BLOCK_SIZE])))
        out.append(parent)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iterations", type=int, default=2000)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "block_hashing.json"))
    args = ap.parse_args()
    tokens = [(i * 7919) % 50_000 for i in range(PROMPT_TOKENS)]
    keys = extra_keys("0123456789abcdef:float32:30:3:64:16:HND", "tenant-a")
    results = {
        "sha256 chain, 2,000 tokens": per_op_us(lambda: hash_blocks(tokens, BLOCK_SIZE, keys), args.iterations),
        "python hash() chain, 2,000 tokens": per_op_us(lambda: python_hash_chain(tokens), args.iterations),
        "sha256, one more block": per_op_us(lambda: hash_blocks(tokens[:16], BLOCK_SIZE, keys), args.iterations),
    }
    for name, us in results.items():
        print(f"{name:36s} {us:8.1f} us")
    print("target: under 500 us per 2,000-token prompt")
    Path(args.out).write_text(json.dumps({"per_op_us": results, "iterations": args.iterations,
                                          "prompt_tokens": PROMPT_TOKENS, "block_size": BLOCK_SIZE},
                                         indent=2) + "\n")


if __name__ == "__main__":
    main()
