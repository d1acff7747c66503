"""TTFT and end-to-end latency through the proxy (1P1D) beside one colocated instance.

    .venv/bin/python bench/serving.py [--model DIR] [--repeats 5] [--max-tokens 32]

Streaming completions, one at a time, prompt lengths 128 to 2,048 tokens (distinct random prompts,
so the prefix cache never helps), colocated and P/D requests interleaved. The colocated instance gets
the same cores and threads as the prefill instance (core 0, one thread); the decode instance gets
core 1. Also: the first request to a fresh pair (handshake and NIXL wire-up included; each instance
warmed by one plain request first) beside a warm request of the same length.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from pdserve.cli import ensure_model  # noqa: E402
from pdserve.launcher import Deployment, Instance  # noqa: E402

LENGTHS = [128, 256, 512, 1024, 2048]
ARGS = ["--kv-cache-gib", "0.5", "--max-num-batched-tokens", "2048"]


def stream_once(client: httpx.Client, url: str, ids: list[int], max_tokens: int) -> tuple[float, float, int]:
    """(TTFT, end-to-end, tokens) of one streamed completion."""
    start = time.perf_counter()
    ttft, tokens = None, 0
    with client.stream("POST", url + "/v1/completions",
                       json={"prompt": ids, "max_tokens": max_tokens, "temperature": 0,
                             "ignore_eos": True, "stream": True}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            if chunk["choices"] and ttft is None:
                ttft = time.perf_counter() - start
            tokens += 1
    return ttft, time.perf_counter() - start, tokens


class Prompts:
    def __init__(self, vocab: int, seed: int = 0):
        self.rng = random.Random(seed)
        self.vocab = vocab

    def make(self, n: int) -> list[int]:
        return [1] + [self.rng.randrange(7, self.vocab) for _ in range(n - 1)]


def measure(targets: dict[str, str], prompts: Prompts, repeats: int, max_tokens: int) -> dict:
    """Interleaved: each repetition sends the same-length prompt to every target in turn, so a slow
    moment of this noisy machine hits both sides alike."""
    runs = {name: {n: [] for n in LENGTHS} for name in targets}
    with httpx.Client(timeout=600) as client:
        for n in LENGTHS:
            for _ in range(repeats):
                for name, url in targets.items():
                    runs[name][n].append(stream_once(client, url, prompts.make(n), max_tokens))
            for name in targets:
                r = runs[name][n]
                runs[name][n] = {"ttft_ms": round(statistics.median(x[0] for x in r) * 1e3, 1),
                                 "e2e_ms": round(statistics.median(x[1] for x in r) * 1e3, 1)}
            print(f"  {n:5} tokens: " + "  ".join(
                f"{name} TTFT {runs[name][n]['ttft_ms']} ms e2e {runs[name][n]['e2e_ms']} ms"
                for name in targets), flush=True)
    return runs


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "serving.json"))
    args = ap.parse_args()
    model = ensure_model(args.model)
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    logs = Path(tempfile.mkdtemp(prefix="pdserve-bench-"))
    results = {"max_tokens": args.max_tokens, "repeats": args.repeats}

    colo = Instance("colocated", ["serve", model, "--port", "0", "--num-threads", "1", "--cpus", "0",
                                  *ARGS], cpus=(0,))
    dep = Deployment(model, [1], [1], instance_args=ARGS, prefill_cpus=[(0,)], decode_cpus=[(1,)],
                     log_dir=str(logs))
    try:
        colo.spawn(logs).wait_healthy()
        dep.start()
        prompts = Prompts(vocab, 2)
        with httpx.Client(timeout=600) as client:
            for url in (colo.url, *[i.url for i in dep.instances]):  # warm every model, unpaired
                stream_once(client, url, prompts.make(64), 4)
            first = stream_once(client, dep.proxy.url, prompts.make(512), args.max_tokens)
            warm = [stream_once(client, dep.proxy.url, prompts.make(512), args.max_tokens)
                    for _ in range(args.repeats)]
        results["first_request_512"] = {
            "first_ttft_ms": round(first[0] * 1e3, 1), "first_e2e_ms": round(first[1] * 1e3, 1),
            "warm_ttft_ms": round(statistics.median(w[0] for w in warm) * 1e3, 1),
            "warm_e2e_ms": round(statistics.median(w[1] for w in warm) * 1e3, 1)}
        f = results["first_request_512"]
        f["e2e_ratio"] = round(f["first_e2e_ms"] / f["warm_e2e_ms"], 2)
        print(f"first request to a fresh pair (512 tokens): e2e {f['first_e2e_ms']} ms vs warm "
              f"{f['warm_e2e_ms']} ms = {f['e2e_ratio']}x (target <= 1.5x); TTFT "
              f"{f['first_ttft_ms']} vs {f['warm_ttft_ms']} ms")
        print("colocated (core 0, 1 thread) and 1P1D through the proxy (P core 0, D core 1):")
        runs = measure({"colocated": colo.url, "pd": dep.proxy.url}, prompts, args.repeats,
                       args.max_tokens)
        results.update(runs)
    finally:
        dep.stop()
        colo.stop()

    print("prompt | TTFT colocated | TTFT P/D | ratio | e2e colocated | e2e P/D | ratio")
    for n in LENGTHS:
        c, p = results["colocated"][n], results["pd"][n]
        p["ttft_vs_colocated"] = round(p["ttft_ms"] / c["ttft_ms"], 2)
        p["e2e_vs_colocated"] = round(p["e2e_ms"] / c["e2e_ms"], 2)
        print(f"{n:6} | {c['ttft_ms']:14} | {p['ttft_ms']:8} | {p['ttft_vs_colocated']:5} | "
              f"{c['e2e_ms']:13} | {p['e2e_ms']:7} | {p['e2e_vs_colocated']:5}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
