"""`pdserve bench serve`: a serving benchmark against any OpenAI-compatible base URL (pdserve's
proxy or an instance, a vLLM server, pdserve's proxy in front of vLLM), in `vllm bench serve`'s
vocabulary and JSON field names.

Benchmark client process. `add_arguments` also serves `pdserve bench sweep`.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime as dt
import json
import logging
import math
import sys
import time
from pathlib import Path

import httpx

from pdserve.bench import client, datasets, machine, stats
from pdserve.heap import PauseTimer, freeze_startup_heap


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--endpoint", default="/v1/completions", help="or /v1/chat/completions")
    p.add_argument("--model", default=None, help="default: the server's first model")
    p.add_argument("--api-key", default=None)
    p.add_argument("--dataset-name", default="random", choices=["random", "chat", "mixed", "prefix-sharing", "jsonl"])
    p.add_argument("--dataset-path", default=None, help="jsonl: one {\"prompt\", \"output_len\"} per line")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--random-input-len", type=int, default=256, help="median prompt tokens (short ones in mixed)")
    p.add_argument("--random-output-len", type=int, default=64)
    p.add_argument("--random-range-ratio", type=float, default=0.0)
    p.add_argument("--mixed-long-fraction", type=float, default=0.25)
    p.add_argument("--mixed-long-len", type=int, default=1536)
    p.add_argument("--prefix-len", type=int, default=256)
    p.add_argument("--num-prefixes", type=int, default=4)
    p.add_argument("--vocab-size", type=int, default=1000, help="token ids are drawn below this")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--request-rate", type=float, default=math.inf, help="requests per second (inf: all at once)")
    p.add_argument("--burstiness", type=float, default=1.0, help="1: Poisson; lower: burstier")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--goodput", nargs="+", default=[], metavar="NAME:MS",
                   help="SLOs a good request meets: ttft, tpot, e2el (vLLM's) and itl (its largest gap)")
    p.add_argument("--metric-percentiles", default="50,90,99")
    p.add_argument("--save-result", action="store_true")
    p.add_argument("--result-dir", default=".")
    p.add_argument("--result-filename", default=None)
    p.add_argument("--disable-tqdm", action="store_true")


def dataset_args(args) -> datasets.DatasetArgs:
    return datasets.DatasetArgs(
        name=args.dataset_name, num_prompts=args.num_prompts, seed=args.seed, input_len=args.random_input_len,
        output_len=args.random_output_len, range_ratio=args.random_range_ratio,
        long_fraction=args.mixed_long_fraction, long_len=args.mixed_long_len, num_prefixes=args.num_prefixes,
        prefix_len=args.prefix_len, path=args.dataset_path, vocab_hi=args.vocab_size, max_len=args.max_model_len)


def first_model(base_url: str, api_key: str | None) -> str | None:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        return httpx.get(base_url + "/v1/models", headers=headers, timeout=10).json()["data"][0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError):
        return None


def benchmark(base_url: str, args, request_rate: float | None = None, seed: int | None = None) -> dict:
    """Run one workload at one rate; the result in vLLM's field names (`seed` replaces --seed)."""
    rate = args.request_rate if request_rate is None else request_rate
    seed = args.seed if seed is None else seed
    model = args.model or first_model(base_url, args.api_key)
    requests = datasets.make(dataclasses.replace(dataset_args(args), seed=seed))
    freeze_startup_heap()  # a collection pausing the client would show as the server's latency
    background = machine.busy_cores(1.0)  # the target is idle now: anything busy is someone else
    if background is not None and background > machine.BUSY_WARNING_CORES:
        print(f"warning: before this run the machine was already {background:.2f} cores busy; another "
              "process competes with the target, so these numbers are not comparable", file=sys.stderr)
    collections = PauseTimer().install()
    cpu_start = time.process_time()
    try:
        results, duration = asyncio.run(client.run(
            base_url, args.endpoint, requests, model, rate, args.burstiness, args.max_concurrency, seed,
            args.api_key, progress=not args.disable_tqdm))
    finally:
        collections.uninstall()
    percentiles = tuple(float(p) for p in args.metric_percentiles.split(","))
    out = stats.summarize(results, duration, stats.parse_goodput(args.goodput), percentiles)
    cpu = time.process_time() - cpu_start  # must stay well below one core, or the client is the limit
    out.update({"client_cpu_seconds": cpu, "client_cpu_share": cpu / duration if duration else 0.0,
                "client_gc_pause_max_ms": max(collections.longest) * 1000, "background_busy_cores": background})
    out.update({"date": dt.datetime.now().strftime("%Y%m%d-%H%M%S"), "backend": "openai", "base_url": base_url,
                "model_id": model, "num_prompts": len(requests), "dataset_name": args.dataset_name,
                "request_rate": rate if math.isfinite(rate) else "inf", "burstiness": args.burstiness,
                "max_concurrency": args.max_concurrency, "seed": seed, "goodput_slos_ms": {
                    k: v * 1000 for k, v in stats.parse_goodput(args.goodput).items()}})
    return out


def report(r: dict) -> str:
    lines = ["============ Serving Benchmark Result ============",
             f"{'Successful requests:':40}{r['completed']}", f"{'Failed requests:':40}{r['failed']}",
             f"{'Benchmark duration (s):':40}{r['duration']:.2f}",
             f"{'Total input tokens:':40}{r['total_input_tokens']}",
             f"{'Total generated tokens:':40}{r['total_output_tokens']}",
             f"{'Request throughput (req/s):':40}{r['request_throughput']:.2f}"]
    if "request_goodput" in r:
        lines.append(f"{'Request goodput (req/s):':40}{r['request_goodput']:.2f}")
    lines.append(f"{'Output token throughput (tok/s):':40}{r['output_throughput']:.2f}")
    lines.append(f"{'Client CPU (share of one core):':40}{r['client_cpu_share']:.2f}")
    for name, title in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
                        ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):
        lines.append(f"{title:-^50}")
        lines.append(f"{f'Mean {name.upper()} (ms):':40}{r[f'mean_{name}_ms']:.2f}")
        lines.append(f"{f'Median {name.upper()} (ms):':40}{r[f'median_{name}_ms']:.2f}")
        for key in sorted(k for k in r if k.startswith("p") and k.endswith(f"_{name}_ms")):
            lines.append(f"{f'P{key[1:].split(chr(95))[0]} {name.upper()} (ms):':40}{r[key]:.2f}")
    lines.append("=" * 50)
    return "\n".join(lines)


def save(r: dict, args, name: str | None = None) -> Path:
    directory = Path(args.result_dir)
    directory.mkdir(parents=True, exist_ok=True)
    rate = r["request_rate"]
    path = directory / (name or args.result_filename or f"pdserve-{rate}qps-{r['date']}.json")
    path.write_text(json.dumps(r) + "\n")
    return path


def quiet() -> None:
    """One line per request from httpx would drown the report."""
    logging.getLogger("httpx").setLevel(logging.WARNING)


def main(args) -> int:
    quiet()
    base_url = args.base_url or f"http://{args.host}:{args.port}"
    r = benchmark(base_url.rstrip("/"), args)
    print(report(r))
    if args.save_result:
        print(f"saved {save(r, args)}")
    return 0 if r["completed"] else 1
