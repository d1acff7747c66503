"""When a producer should pull a conversation's history from decode rather than compute it.

    .venv/bin/python bench/pull_breakeven.py [--repeats 3]

Two 1P1D deployments of the `small` model (P on core 0, D on core 1, one thread each, the proxy
routing `least-loaded` so every turn goes through the producer): one whose producer pulls whenever
it can (`--kv-pull-min-tokens 16`), one that never pulls (`0`). For each history length, a first
turn leaves its prompt and a 64-token answer in decode's cache; the producer's cache is reset
(`POST /reset_prefix_cache`, as after an eviction); the second turn (the history plus 16 new
tokens) is timed to its first token. The break-even is the shortest history from which pulling is
faster in every repeat. Results: bench/results/pull_breakeven.json.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from multiturn import stream  # noqa: E402
from pdserve.cli import ensure_model  # noqa: E402
from pdserve.launcher import Deployment  # noqa: E402

HISTORIES = [16, 48, 112, 240, 496]  # first-turn prompt tokens (+ the 63 answer tokens decode computed)
ANSWER, NEW = 64, 16


def deployment(model: str, pull_min: int, log_dir: Path) -> Deployment:
    return Deployment(model, [1], [1], prefill_cpus=[(0,)], decode_cpus=[(1,)], log_dir=str(log_dir),
                      instance_args=["--num-blocks", "512"], proxy_args=["--routing", "least-loaded"],
                      role_args={"prefill": ["--kv-pull-min-tokens", str(pull_min)]}).start()


def second_turn_ttft(dep: Deployment, client: httpx.Client, history: int, seed: int) -> float:
    rng = random.Random(seed)
    first = [rng.randrange(7, 1000) for _ in range(history)]
    answer = stream(client, dep.proxy.url, first, ANSWER)["answer"]
    client.post(dep.prefill[0].url + "/reset_prefix_cache").raise_for_status()
    second = first + answer + [rng.randrange(7, 1000) for _ in range(NEW)]
    return stream(client, dep.proxy.url, second, 2)["ttft_ms"] / 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    model = ensure_model(None)
    log_dir = Path("/tmp/pdserve-pull-breakeven")
    results = {}
    for name, pull_min in (("pull", 16), ("compute", 0)):
        dep = deployment(model, pull_min, log_dir / name)
        try:
            with httpx.Client(timeout=120) as client:
                second_turn_ttft(dep, client, 64, seed=999)  # warm-up: handshakes, kernels
                results[name] = {h: [second_turn_ttft(dep, client, h, seed=1000 * r + h) * 1e3
                                     for r in range(args.repeats)] for h in HISTORIES}
        finally:
            dep.stop()
    rows = []
    for h in HISTORIES:
        held = (h + ANSWER - 1) // 16 * 16
        pull, compute = results["pull"][h], results["compute"][h]
        rows.append({"history_tokens": h + ANSWER, "pulled_tokens": held,
                     "ttft_ms_pull": round(statistics.median(pull), 1),
                     "ttft_ms_compute": round(statistics.median(compute), 1),
                     "pull_faster_every_repeat": all(a < b for a, b in zip(sorted(pull), sorted(compute)))})
    breakeven = next((r["pulled_tokens"] for r in rows if r["pull_faster_every_repeat"]
                      and all(s["pull_faster_every_repeat"] for s in rows[rows.index(r):])), None)
    out = {"repeats": args.repeats, "rows": rows, "breakeven_pulled_tokens": breakeven}
    Path("bench/results/pull_breakeven.json").write_text(json.dumps(out, indent=1) + "\n")
    for r in rows:
        print(f"{r['pulled_tokens']:5d} tokens held by decode: TTFT {r['ttft_ms_pull']:7.1f} ms pulling, "
              f"{r['ttft_ms_compute']:7.1f} ms computing")
    print(f"break-even: pulling wins from {breakeven} tokens")


if __name__ == "__main__":
    main()
