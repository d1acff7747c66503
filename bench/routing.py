"""Routing policies side by side on mock instances: a trace replayed through 4 producers and
4 decode instances (`pdserve up --mock-engine`), under kv-aware, least-loaded and round-robin.

    .venv/bin/python bench/routing.py [--rows 800] [--speedup 1] [--num-blocks 384] [--quick]

The trace is Mooncake's format (timestamp, input_length, output_length, hash_ids, session_id),
made here and written next to the results: conversations that share a few system prompts and whose
turns carry their history (each turn appends its own hash ids), arriving over time with think time
between turns. Each hash id is 64 tokens (`--trace-block-tokens 64`, 4 KV blocks); every instance
holds ~4.5 % of the trace's unique blocks (`--num-blocks`). Answers are short (16-64 tokens): the
benchmark is about prefill and TTFT, and eight instances stepping through long answers would keep
this machine's two cores busy with the engines' own overhead. Per policy: the prefix hit rate
(prompt tokens no instance computed) beside what one LRU cache of all the instances' blocks would
reach on the same requests and (kv-aware) the share of prompt tokens some instance held when the
proxy placed the request (what routing could have reused), how many instances cache each cached
block at the end (what the caches together hold is their size over this), how evenly the load
spread (busiest over mean: prompt tokens a producer computed, tokens a decode instance generated),
the proxy's P/D decisions and TTFT p50/p90.
Results: bench/results/routing.json. Each run's trace, bench result and the proxy's placement log
stay in the work directory it prints; `bench/copies_model.py --placements W/kv-aware-0.placements.jsonl
--result W/kv-aware-0.json --trace W/trace.jsonl` replays where the proxy put each request.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from pdserve.bench.machine import busy_cores  # noqa: E402
from pdserve.bench.trace import conversation_trace  # noqa: E402
from pdserve.cli import ensure_model  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PDSERVE = [sys.executable, "-m", "pdserve.cli"]
POLICIES = ("kv-aware", "kv-aware/both-copies", "least-loaded", "least-loaded/no-pulls", "round-robin")
BLOCK_TOKENS = 64  # tokens per trace hash id here
NUM_BLOCKS = 384  # KV blocks per instance (16 tokens each): ~4.5 % of the default trace's unique blocks


def metric_sum(url: str, name: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        return sum(float(line.rsplit(" ", 1)[1]) for line in r.read().decode().splitlines()
                   if line.startswith(name + "{") or line.startswith(name + " "))


def copies_per_block(proxy: str) -> float | None:
    """How many instances cache each block some instance caches, on average (the proxy's KV index,
    settled): 1 when the instances' caches hold distinct KV, 8 when all hold the same."""
    with urllib.request.urlopen(proxy + "/kv/index?hashes=true", timeout=30) as r:
        held = [set(h) for h in json.loads(r.read())["instances"].values()]
    union = set().union(*held) if held else set()
    return round(sum(map(len, held)) / len(union), 3) if union else None


def run_up(model: str, policy: str, up_args: list[str], bench_args: list[str], work: Path,
           proxy_args: str = "") -> dict:
    """`pdserve up MODEL --routing POLICY *up_args --proxy-args PROXY_ARGS`, then `pdserve bench serve
    *bench_args` through its proxy with every instance's counters; the bench's result with per-instance
    computed prompt tokens (`computed`), how evenly each pool computed them (`busiest_over_mean`) and
    the proxy's P/D decisions. The proxy logs its placements to WORK/NAME.placements.jsonl beside the
    bench's WORK/NAME.json (bench/copies_model.py --placements replays them)."""
    name = f"{policy}-{len(list(work.glob('*.up.log')))}"
    proxy_args = f"--placement-log {work / name}.placements.jsonl {proxy_args}".strip()
    busy = busy_cores()  # what else ran: numbers from a busy machine are not comparable
    port_file = work / f"{name}.port"
    up = subprocess.Popen(
        [*PDSERVE, "up", model, "--routing", policy, "--port", "0", "--port-file", str(port_file),
         "--log-dir", str(work / name), "--proxy-args", proxy_args, *up_args],
        stdout=subprocess.DEVNULL, stderr=open(work / f"{name}.up.log", "w"), start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not port_file.exists():
            if up.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"pdserve up ({policy}) did not start: {work / f'{name}.up.log'}")
            time.sleep(0.5)
        proxy = "http://127.0.0.1:%d" % json.loads(port_file.read_text())["port"]
        health = json.loads(urllib.request.urlopen(proxy + "/health", timeout=30).read())
        instances = {role: sorted(health[role]) for role in ("prefill", "decode")}
        urls = instances["prefill"] + instances["decode"]
        counters = ("pdserve:prompt_tokens_computed_total", "pdserve:generation_tokens_total")
        before = {(u, c): metric_sum(u, c) for u in urls for c in counters}
        result = work / f"{name}.json"
        subprocess.run(
            [*PDSERVE, "bench", "serve", "--base-url", proxy, *bench_args, "--save-result", "--result-dir",
             str(work), "--result-filename", result.name, "--disable-tqdm",
             *[x for u in urls for x in ("--metrics-url", u)]],
            check=True, timeout=1800, stdout=subprocess.DEVNULL)
        bench = json.loads(result.read_text())
        tokens = {u: metric_sum(u, counters[0]) - before[u, counters[0]] for u in urls}
        generated = {u: metric_sum(u, counters[1]) - before[u, counters[1]] for u in instances["decode"]}
        bench["decisions"] = {d: metric_sum(proxy, f'pdserve_proxy:pd_decisions_total{{decision="{d}"}}')
                              for d in ("local", "remote")}
        placed = metric_sum(proxy, "pdserve_proxy:prompt_tokens_placed_total")
        bench["cached_anywhere_rate"] = round(
            metric_sum(proxy, "pdserve_proxy:prompt_tokens_cached_anywhere_total") / placed, 4) if placed else None
        bench["copies_per_cached_block"] = copies_per_block(proxy)
        bench["computed"] = tokens
        bench["busy_cores_before"] = None if busy is None else round(busy, 2)
        bench["generated"] = generated
        # load: prompt tokens a producer computed, tokens a decode instance generated (its local
        # prefills, a small share of its work, are in `computed`)
        loads = {"prefill": [tokens[u] for u in instances["prefill"]],
                 "decode": [generated[u] for u in instances["decode"]]}
        bench["busiest_over_mean"] = {role: round(max(v) / (sum(v) / len(v)), 3) if sum(v) else None
                                      for role, v in loads.items()}
        return bench
    finally:
        os.killpg(up.pid, signal.SIGTERM)
        try:
            up.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(up.pid, signal.SIGKILL)


def run_policy(model: str, policy: str, trace: Path, args, work: Path) -> dict:
    """`policy`, or `least-loaded/no-pulls`: producers never claim blocks from other instances, so each
    instance reuses only its own cache (as a cache-blind router's deployment does elsewhere), or
    `kv-aware/both-copies`: the producer and the decode instance both keep a prompt's KV alike."""
    routing, _, variant = policy.partition("/")
    extra = " --kv-pull-min-tokens 0" if variant == "no-pulls" else ""
    bench = run_up(
        model, routing, ["--mock-engine", "--mock-speedup", str(args.speedup), "--prefill", "4", "--decode", "4",
                         "--instance-args", f"--num-blocks {args.num_blocks} --max-num-seqs 16{extra}"],
        ["--dataset-name", "trace", "--dataset-path", str(trace), "--trace-block-tokens", str(BLOCK_TOKENS),
         "--trace-time-scale", str(args.time_scale), "--lru-bound-blocks", str(args.num_blocks * 8)], work,
        "--kv-copies both" if variant == "both-copies" else "")
    return {"policy": policy, "ttft_p50_ms": bench.get("median_ttft_ms"), "ttft_p90_ms": bench.get("p90_ttft_ms"),
            "itl_p99_ms": bench.get("p99_itl_ms"), "e2el_p90_ms": bench.get("p90_e2el_ms"),
            "completed": bench.get("completed"), "failed": bench.get("failed"),
            "prefix_hit_rate": bench.get("prefill_hit_rate"), "lru_bound_hit_rate": bench.get("lru_bound_hit_rate"),
            "unbounded_cache_hit_rate": bench.get("unbounded_cache_hit_rate"),
            "cached_anywhere_rate": bench["cached_anywhere_rate"], "copies_per_cached_block": bench["copies_per_cached_block"],
            "busiest_over_mean": bench["busiest_over_mean"], "prompt_tokens_computed_by_instance": bench["computed"],
            "tokens_generated_by_decode_instance": bench["generated"],
            "decisions": bench["decisions"], "busy_cores_before": bench["busy_cores_before"]}


def plot(out: dict, path: Path) -> None:
    """Per policy: hit rate beside the LRU bound, TTFT p50/p90, prompt tokens each instance computed."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    results = out["results"]
    names = [r["policy"].replace("/", "\n").replace("-", "-\n") for r in results]
    fig, (hit, ttft, load) = plt.subplots(1, 3, figsize=(13, 3.6))
    hit.bar(names, [r["prefix_hit_rate"] for r in results], color="tab:blue", label="hit rate")
    hit.plot(names, [r["lru_bound_hit_rate"] for r in results], "k_", markersize=40, label="one LRU cache")
    hit.set_ylim(0, 1)
    hit.set_title("prefix hit rate")
    hit.legend(loc="lower right", fontsize=8)
    x = range(len(names))
    ttft.bar([i - 0.2 for i in x], [r["ttft_p50_ms"] for r in results], 0.4, label="p50")
    ttft.bar([i + 0.2 for i in x], [r["ttft_p90_ms"] for r in results], 0.4, label="p90")
    ttft.set_xticks(list(x), names)
    ttft.set_title("TTFT (ms)")
    ttft.legend(fontsize=8)
    for i, r in enumerate(results):
        tokens = list(r["prompt_tokens_computed_by_instance"].values())
        width = 0.8 / len(tokens)
        load.bar([i - 0.4 + width * (j + 0.5) for j in range(len(tokens))], tokens, width,
                 color=["tab:orange"] * 4 + ["tab:green"] * (len(tokens) - 4))
    load.set_xticks(list(x), names)
    load.set_title("prompt tokens computed per instance\n(orange: producers, green: decode)", fontsize=9)
    fig.suptitle(f"4P4D mock instances, {out['rows']}-request conversation trace", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=800)
    p.add_argument("--num-blocks", type=int, default=NUM_BLOCKS, help="KV blocks per instance")
    p.add_argument("--speedup", type=float, default=1.0, help="--mock-speedup of every instance")
    p.add_argument("--time-scale", type=float, default=1.0, help="--trace-time-scale")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="60 rows, kv-aware and least-loaded only")
    p.add_argument("--policies", default=",".join(POLICIES), help="comma-separated, kv-aware first")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "routing.json"))
    args = p.parse_args()
    rows = 60 if args.quick else args.rows
    model = ensure_model(None)
    work = Path(tempfile.mkdtemp(prefix="pdserve-routing-"))
    trace = work / "trace.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in conversation_trace(rows, args.seed)))
    policies = POLICIES[:2] if args.quick else tuple(args.policies.split(","))
    results = [run_policy(model, policy, trace, args, work) for policy in policies]
    by = {r["policy"]: r for r in results}
    kv, ll = by["kv-aware"], by.get("least-loaded", {})
    summary = {
        "hit_rate_over_lru_bound": round(kv["prefix_hit_rate"] / kv["lru_bound_hit_rate"], 3)
        if kv["prefix_hit_rate"] is not None and kv["lru_bound_hit_rate"] else None,
        "kv_aware_busiest_over_mean": kv["busiest_over_mean"],
        "ttft_p90_least_loaded_over_kv_aware": round(ll["ttft_p90_ms"] / kv["ttft_p90_ms"], 2)
        if kv["ttft_p90_ms"] and ll.get("ttft_p90_ms") else None,
        "ttft_p90_over_kv_aware": {r["policy"]: round(r["ttft_p90_ms"] / kv["ttft_p90_ms"], 2)
                                   for r in results if r is not kv and r["ttft_p90_ms"] and kv["ttft_p90_ms"]},
        "ttft_p50_over_kv_aware": {r["policy"]: round(r["ttft_p50_ms"] / kv["ttft_p50_ms"], 2)
                                   for r in results if r is not kv and r["ttft_p50_ms"] and kv["ttft_p50_ms"]}}
    out = {"rows": rows, "speedup": args.speedup, "time_scale": args.time_scale, "num_blocks_per_instance": args.num_blocks,
           "block_tokens_per_hash_id": BLOCK_TOKENS, "results": results, "summary": summary}
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    plot(out, Path(args.out).with_suffix(".png"))
    for r in results:
        print(f"{r['policy']:13} hit rate {r['prefix_hit_rate']} (LRU bound {r['lru_bound_hit_rate']}), "
              f"TTFT p50/p90 {r['ttft_p50_ms']}/{r['ttft_p90_ms']} ms, busiest/mean {r['busiest_over_mean']}")
    print(json.dumps(summary))
    print(f"trace, bench results and placement logs: {work}")


if __name__ == "__main__":
    main()
