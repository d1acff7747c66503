"""What the proxy adds to a request: the two calls of vLLM's protocol made by the client itself
(prefill with do_remote_decode, then decode with the params) against the same request through
`pdserve proxy`, interleaved, on one 1P1D pair.

    .venv/bin/python bench/proxy_overhead.py [--requests 200] [--prompt-tokens 64] [--max-tokens 4]

Non-streaming, one request at a time, so the difference of the medians is the proxy's own time per
request (parsing, routing, two upstream calls through its pooled clients). Target: < 2 ms at p50.
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
from pdserve.launcher import Deployment  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "proxy_overhead.json"))
    args = ap.parse_args()
    model = ensure_model(args.model, "tiny")
    rng = random.Random(0)
    with Deployment(model, [1], [1], instance_args=["--num-blocks", "512"],
                    log_dir=tempfile.mkdtemp(prefix="pdserve-proxy-bench-")) as dep, httpx.Client(timeout=60) as h:
        p_url, d_url, x_url = dep.prefill[0].url, dep.decode[0].url, dep.proxy.url

        def body() -> dict:
            return {"prompt": [1] + [rng.randrange(7, 1000) for _ in range(args.prompt_tokens - 1)],
                    "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True}

        def direct() -> float:
            b = body()
            start = time.perf_counter()
            first = h.post(p_url + "/v1/completions", json={**b, "kv_transfer_params": {"do_remote_decode": True}})
            kv = first.json()["kv_transfer_params"]
            r = h.post(d_url + "/v1/completions", json={**b, "kv_transfer_params": kv})
            assert r.status_code == 200, r.text
            return time.perf_counter() - start

        def proxied() -> float:
            start = time.perf_counter()
            r = h.post(x_url + "/v1/completions", json=body())
            assert r.status_code == 200, r.text
            return time.perf_counter() - start
        for _ in range(10):  # warm: handshake, NIXL wire-up, kernels
            direct(), proxied()
        times = {"direct": [], "proxy": []}
        for _ in range(args.requests):
            times["direct"].append(direct())
            times["proxy"].append(proxied())
    med = {k: statistics.median(v) * 1000 for k, v in times.items()}
    result = {"requests": args.requests, "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
              "direct_p50_ms": round(med["direct"], 3), "proxy_p50_ms": round(med["proxy"], 3),
              "overhead_p50_ms": round(med["proxy"] - med["direct"], 3)}
    print(json.dumps(result, indent=1))
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
