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

from pdserve.bench import client, datasets, instance_counters, lru_bound, machine, stats
from pdserve.heap import PauseTimer, freeze_startup_heap


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--endpoint", default="/v1/completions", help="or /v1/chat/completions")
    p.add_argument("--model", default=None, help="default: the server's first model")
    p.add_argument("--api-key", default=None)
    p.add_argument("--dataset-name", default="random", choices=datasets.NAMES)
    p.add_argument("--dataset-path", default=None, help="jsonl: one {\"prompt\", \"output_len\"} per line; "
                   "trace: Mooncake's JSONL (timestamp, input_length, output_length, hash_ids)")
    p.add_argument("--num-prompts", type=int, default=None, help="default 100; trace: every row")
    p.add_argument("--random-input-len", type=int, default=256, help="median prompt tokens (short ones in mixed)")
    p.add_argument("--random-output-len", type=int, default=64)
    p.add_argument("--random-range-ratio", type=float, default=0.0)
    p.add_argument("--mixed-long-fraction", type=float, default=0.25)
    p.add_argument("--mixed-long-len", type=int, default=1536)
    p.add_argument("--prefix-len", type=int, default=256)
    p.add_argument("--num-prefixes", type=int, default=4)
    _add_reuse_workloads(p)
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
    g = p.add_argument_group("reuse: the instances' counters and the LRU bound")
    g.add_argument("--metrics-url", action="append", default=[], metavar="URL",
                   help="an instance whose /metrics to read before and after the run (repeat per instance)")
    g.add_argument("--lru-bound-blocks", type=int, default=None, metavar="N",
                   help="report the prefix hit rate one LRU cache of N blocks reaches on the same requests")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block (the LRU bound's)")


def _add_reuse_workloads(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("shared-prefix (inference-perf's shared_prefix)")
    g.add_argument("--shared-prefix-num-groups", type=int, default=4)
    g.add_argument("--shared-prefix-prompts-per-group", type=int, default=8)
    g.add_argument("--shared-prefix-system-len", type=int, default=256, help="tokens shared by a group")
    g.add_argument("--shared-prefix-question-len", type=int, default=64, help="tokens of each prompt's own")
    g.add_argument("--shared-prefix-output-len", type=int, default=64)
    g = p.add_argument_group("multi-turn (each turn's prompt: the previous prompt and answer, then new tokens)")
    g.add_argument("--multi-turn-num-sessions", type=int, default=8, help="started at --request-rate")
    g.add_argument("--multi-turn-num-turns", type=int, default=4, help="turns per session")
    g.add_argument("--multi-turn-system-len", type=int, default=256, help="each session's own system prompt")
    g.add_argument("--multi-turn-user-len", type=int, default=64, help="new tokens per user turn")
    g.add_argument("--multi-turn-answer-len", type=int, default=64)
    g.add_argument("--multi-turn-think-time-s", type=float, default=1.0, help="between an answer and the next turn")
    g.add_argument("--multi-turn-think-time-dist", default="exponential", choices=["exponential", "fixed"])
    g = p.add_argument_group("trace (--dataset-path FILE.jsonl, Mooncake's format)")
    g.add_argument("--trace-block-tokens", type=int, default=512,
                   help="token ids per hash id; lengths scale by this / --trace-source-block-tokens")
    g.add_argument("--trace-source-block-tokens", type=int, default=512, help="the trace's tokens per hash id")
    g.add_argument("--trace-time-scale", type=float, default=1.0, help="multiplies timestamps (0.5: twice as fast)")
    g.add_argument("--max-input-len", type=int, default=None, help="prompts cut to this many tokens")


def dataset_args(args) -> datasets.DatasetArgs:
    num_prompts = args.num_prompts if args.num_prompts is not None else None if args.dataset_name == "trace" else 100
    return datasets.DatasetArgs(
        name=args.dataset_name, num_prompts=num_prompts, seed=args.seed, input_len=args.random_input_len,
        output_len=args.random_output_len, range_ratio=args.random_range_ratio,
        long_fraction=args.mixed_long_fraction, long_len=args.mixed_long_len, num_prefixes=args.num_prefixes,
        prefix_len=args.prefix_len, path=args.dataset_path, vocab_hi=args.vocab_size, max_len=args.max_model_len,
        shared_prefix=datasets.SharedPrefixArgs(
            args.shared_prefix_num_groups, args.shared_prefix_prompts_per_group, args.shared_prefix_system_len,
            args.shared_prefix_question_len, args.shared_prefix_output_len),
        multi_turn=datasets.MultiTurnArgs(
            args.multi_turn_num_sessions, args.multi_turn_num_turns, args.multi_turn_system_len, args.multi_turn_user_len,
            args.multi_turn_answer_len, args.multi_turn_think_time_s, args.multi_turn_think_time_dist),
        trace=datasets.TraceArgs(args.trace_block_tokens, args.trace_source_block_tokens, args.trace_time_scale,
                                 args.max_input_len))


def first_model(base_url: str, api_key: str | None) -> str | None:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        return httpx.get(base_url + "/v1/models", headers=headers, timeout=10).json()["data"][0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError):
        return None


def benchmark(base_url: str, args, request_rate: float | None = None, seed: int | None = None,
              metrics_urls: list[str] | None = None) -> dict:
    """Run one workload at one rate; the result in vLLM's field names (`seed` replaces --seed,
    `metrics_urls` --metrics-url)."""
    rate = args.request_rate if request_rate is None else request_rate
    seed = args.seed if seed is None else seed
    metrics_urls = [u.rstrip("/") for u in (args.metrics_url if metrics_urls is None else metrics_urls)]
    model = args.model or first_model(base_url, args.api_key)
    workload = datasets.build(dataclasses.replace(dataset_args(args), seed=seed))
    requests = workload.requests
    if workload.info.get("trace_rows_skipped"):
        print(f"warning: {workload.info['trace_rows_skipped']} malformed trace rows skipped", file=sys.stderr)
    bounds = [lru_bound.LRUBound(None, args.block_size)]
    if args.lru_bound_blocks is not None:
        bounds.append(lru_bound.LRUBound(args.lru_bound_blocks, args.block_size))
    freeze_startup_heap()  # a collection pausing the client would show as the server's latency
    background = machine.busy_cores(1.0)  # the target is idle now: anything busy is someone else
    if background is not None and background > machine.BUSY_WARNING_CORES:
        print(f"warning: before this run the machine was already {background:.2f} cores busy; another "
              "process competes with the target, so these numbers are not comparable", file=sys.stderr)
    counted = instance_counters.scrape(metrics_urls, args.api_key) if metrics_urls else None
    collections = PauseTimer().install()
    cpu_start = time.process_time()
    try:
        results, duration = asyncio.run(client.run(
            base_url, args.endpoint, requests, model, rate, args.burstiness, args.max_concurrency, seed,
            args.api_key, progress=not args.disable_tqdm, bounds=bounds))
    finally:
        collections.uninstall()
    percentiles = tuple(float(p) for p in args.metric_percentiles.split(","))
    out = stats.summarize(results, duration, stats.parse_goodput(args.goodput), percentiles)
    out.update(workload.info)
    if counted is not None:
        after = instance_counters.scrape(metrics_urls, args.api_key)
        out.update(instance_counters.summarize(instance_counters.delta(counted, after), out["total_input_tokens"]))
    if bounds[0].num_queried_tokens:  # token-id prompts: what one cache would have reused
        out["unbounded_cache_hit_rate"] = bounds[0].hit_rate
        if len(bounds) > 1:
            out.update({"lru_bound_blocks": args.lru_bound_blocks, "lru_bound_hit_rate": bounds[1].hit_rate})
        out["block_size"] = args.block_size
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
    if "median_ttft_ms_by_turn" in r:
        lines.append(f"{'Median TTFT by turn (ms):':40}" + " ".join(f"{x:.0f}" for x in r["median_ttft_ms_by_turn"]))
    lines += reuse_report(r)
    lines.append("=" * 50)
    return "\n".join(lines)


def reuse_report(r: dict) -> list[str]:
    """The prefix reuse the instances counted, beside what one cache would reach."""
    rows = []
    if "trace_rows" in r:
        rows.append(("Trace rows (malformed, skipped):", f"{r['trace_rows']} ({r['trace_rows_skipped']})"))
    if "prefix_cache_hit_rate" in r:
        rows.append(("Prefix cache hit rate (hits/queries):", f"{r['prefix_cache_hit_rate']:.1%}"))
    if "prompt_tokens_computed" in r:
        rows.append(("Prompt tokens computed:", f"{r['prompt_tokens_computed']:.0f}"))
    if "prefill_hit_rate" in r:
        rows.append(("Prompt tokens not computed:", f"{r['prefill_hit_rate']:.1%}"))
    if "lru_bound_hit_rate" in r:
        rows.append((f"LRU bound ({r['lru_bound_blocks']} blocks of {r['block_size']}):",
                     f"{r['lru_bound_hit_rate']:.1%}"))
    if "unbounded_cache_hit_rate" in r:
        rows.append(("Reuse in the workload (no eviction):", f"{r['unbounded_cache_hit_rate']:.1%}"))
    blocks = [f"{r[k]:.0f}" if k in r else "n/a" for k in ("kv_blocks_read", "kv_blocks_read_skipped",
                                                             "kv_blocks_pulled")]
    if any(b != "n/a" for b in blocks):
        rows.append(("KV blocks read / skipped / pulled:", " / ".join(blocks)))
    if "kv_bytes_transferred" in r:
        rows.append(("KV bytes transferred:", f"{r['kv_bytes_transferred']:.0f}"))
    return [f"{'Prefix reuse':-^50}", *(f"{k:40}{v}" for k, v in rows)] if rows else []


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
    try:
        r = benchmark(base_url.rstrip("/"), args)
    except ValueError as e:  # the workload's arguments or file
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(report(r))
    if args.save_result:
        print(f"saved {save(r, args)}")
    return 0 if r["completed"] else 1
