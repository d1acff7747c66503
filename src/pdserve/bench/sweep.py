"""`pdserve bench sweep`: one workload over a list of request rates against a list of deployments,
with plots and a table.

Benchmark client process. A target is `NAME=URL`, or `NAME=up MODEL [flags]` / `NAME=serve MODEL
[flags]`: a `pdserve up` or `pdserve serve` this command starts (on the cores its flags give),
warms up, sweeps, and stops. Each rate sends new prompts (`--seed` plus the rate's index: the same
prompts again would be served from the prefix cache), and every target gets the same ones. The
instances' counters (bench/instance_counters.py) are read from the target's instances: a pdserve
proxy's (from its /health), else the target itself, unless --metrics-url names them. Writes
sweep.json, sweep.md and PNGs (TTFT and ITL p50/p99 against rate, goodput against rate, the ITL CDF
at one rate) into `--result-dir`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import tempfile
from pathlib import Path

import httpx

from pdserve.bench import datasets, instance_counters, serve
from pdserve.bench.machine import BUSY_WARNING_CORES
from pdserve.launcher import Instance


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", action="append", required=True, metavar="NAME=URL|up ...|serve ...")
    p.add_argument("--request-rates", required=True, help="comma-separated, e.g. 0.5,1,2,4")
    p.add_argument("--cdf-rate", type=float, default=None, help="the rate of the ITL CDF (default: the middle)")
    serve.add_arguments(p)


def parse_target(spec: str) -> tuple[str, str]:
    name, sep, what = spec.partition("=")
    if not sep or not name or not what:
        raise ValueError(f"--target takes NAME=URL or NAME=up|serve ..., got {spec!r}")
    return name, what.strip()


class Target:
    """A deployment to sweep: a URL as given, or a `pdserve up` / `pdserve serve` started here."""

    def __init__(self, name: str, what: str, log_dir: Path):
        self.name = name
        self.url = what.rstrip("/") if what.startswith("http") else None
        self.instance = None
        if self.url is None:
            argv = shlex.split(what)
            if argv[0] not in ("up", "serve"):
                raise ValueError(f"target {name}: expected a URL, `up ...` or `serve ...`, got {what!r}")
            self.instance = Instance(name, [*argv, "--port", "0"])
            self.log_dir = log_dir

    def __enter__(self) -> "Target":
        if self.instance is not None:
            self.instance.spawn(self.log_dir).wait_healthy(300)
            self.url = self.instance.url
        return self

    def __exit__(self, *exc) -> None:
        if self.instance is not None:
            self.instance.stop(60)


def warm_up(url: str, args) -> None:
    """Short and long prompts first: kernels built, KV pages touched, connections made."""
    longest = max((r.prompt_len for r in datasets.make(serve.dataset_args(args))), default=64)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    for n in (64, min(longest, args.max_model_len - 16), 64, min(longest, args.max_model_len - 16)):
        body = {"prompt": [1] + [7 + i % 500 for i in range(n - 1)], "max_tokens": 8, "ignore_eos": True}
        if args.model:
            body["model"] = args.model
        httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=300)


def main(args) -> int:
    serve.quiet()
    rates = [float(r) for r in args.request_rates.split(",")]
    out_dir = Path(args.result_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    log_dir = Path(tempfile.mkdtemp(prefix="pdserve-sweep-"))
    runs = []
    for spec in args.target:
        name, what = parse_target(spec)
        with Target(name, what, log_dir) as target:
            warm_up(target.url, args)
            metrics_urls = args.metrics_url or instance_counters.instance_urls(target.url, args.api_key)
            for i, rate in enumerate(rates):  # new prompts at each rate: none is in a prefix cache
                r = serve.benchmark(target.url, args, rate, seed=args.seed + i, metrics_urls=metrics_urls)
                r["target"] = name
                print(f"{name} at {rate:g} req/s: goodput {r.get('request_goodput', 0):.2f} req/s, "
                      f"TTFT p50 {r['median_ttft_ms']:.0f} ms, ITL p99 {r['p99_itl_ms']:.0f} ms, "
                      f"client CPU {r['client_cpu_share']:.0%} of a core", flush=True)
                runs.append(r)
    summary = {"rates": rates, "targets": [parse_target(t)[0] for t in args.target],
               "workload": dataclasses.asdict(serve.dataset_args(args)), "goodput_slos_ms": runs[0]["goodput_slos_ms"],
               "runs": [_compact(r) for r in runs]}
    (out_dir / "sweep.json").write_text(json.dumps(summary, indent=1) + "\n")
    (out_dir / "sweep.md").write_text(table(summary) + "\n")
    cdf_rate = args.cdf_rate if args.cdf_rate is not None else rates[len(rates) // 2]
    plot(summary, runs, cdf_rate, out_dir)
    print(table(summary))
    return 0


def _compact(r: dict) -> dict:
    """A run without its per-request lists (kept apart for the CDF)."""
    return {k: v for k, v in r.items() if not isinstance(v, list)} | {
        "p99_max_itl_per_request_ms": _p99(r["max_itl_per_request_ms"])}


def _p99(xs: list[float]) -> float:
    from pdserve.bench.stats import percentile
    return percentile(xs, 99)


def table(summary: dict) -> str:
    slos = ", ".join(f"{k} ≤ {v:g} ms" for k, v in summary["goodput_slos_ms"].items()) or "none"
    local = any(r.get("pd_decisions", {}).get("local") for r in summary["runs"])
    reuse = any("prefill_hit_rate" in r for r in summary["runs"])
    lines = [f"Goodput counts requests meeting every SLO ({slos}).", "",
             "| target | rate req/s | completed | goodput req/s (share) | TTFT p50 / p99 ms | ITL p50 / p99 ms | "
             "max ITL p99 ms | TPOT p50 ms |" + (" prefilled on decode |" if local else "")
             + (" prompt tokens not computed (LRU bound) |" if reuse else ""),
             "|---|---|---|---|---|---|---|---|" + ("---|" if local else "") + ("---|" if reuse else "")]
    for r in summary["runs"]:
        row = (f"| {r['target']} | {r['request_rate']} | {r['completed']} | "
               f"{r.get('request_goodput', 0):.2f} ({r.get('goodput_fraction', 0):.0%}) | "
               f"{r['median_ttft_ms']:.0f} / {r['p99_ttft_ms']:.0f} | {r['median_itl_ms']:.0f} / "
               f"{r['p99_itl_ms']:.0f} | {r['p99_max_itl_per_request_ms']:.0f} | {r['median_tpot_ms']:.0f} |")
        if local:
            decisions = r.get("pd_decisions")
            row += f" {decisions.get('local', 0)} of {sum(decisions.values())} |" if decisions else " – |"
        if reuse:
            bound = f" ({r['lru_bound_hit_rate']:.0%})" if "lru_bound_hit_rate" in r else ""
            row += f" {r['prefill_hit_rate']:.0%}{bound} |" if "prefill_hit_rate" in r else " – |"
        lines.append(row)
    busy = [f"{r['target']} at {r['request_rate']} req/s ({r['background_busy_cores']:.2f} cores)"
            for r in summary["runs"] if (r.get("background_busy_cores") or 0) > BUSY_WARNING_CORES]
    if busy:
        lines += ["", "Not comparable: other work kept the machine busy before " + ", ".join(busy) + "."]
    return "\n".join(lines)


def plot(summary: dict, runs: list[dict], cdf_rate: float, out_dir: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    by_target: dict[str, list[dict]] = {}
    for r in summary["runs"]:
        by_target.setdefault(r["target"], []).append(r)
    for metric, title in (("ttft", "TTFT"), ("itl", "ITL")):
        fig, ax = plt.subplots(figsize=(6, 3.6))
        for name, rs in by_target.items():
            rates = [float(r["request_rate"]) for r in rs]
            line, = ax.plot(rates, [r[f"median_{metric}_ms"] for r in rs], marker="o", label=f"{name} p50")
            ax.plot(rates, [r[f"p99_{metric}_ms"] for r in rs], marker="x", linestyle="--", color=line.get_color(),
                    label=f"{name} p99")
        ax.set(xlabel="request rate (req/s)", ylabel=f"{title} (ms)", yscale="log", title=f"{title} against rate")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out_dir / f"{metric}.png", dpi=100)
        plt.close(fig)
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for name, rs in by_target.items():
        ax.plot([float(r["request_rate"]) for r in rs], [r.get("request_goodput", 0) for r in rs], marker="o",
                label=name)
    ax.set(xlabel="request rate (req/s)", ylabel="goodput (req/s)", title="goodput against rate")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out_dir / "goodput.png", dpi=100)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for r in runs:
        if float(r["request_rate"]) == cdf_rate:
            gaps = sorted(g * 1000 for gs in r["itls"] for g in gs)
            if gaps:
                ax.plot(gaps, [(i + 1) / len(gaps) for i in range(len(gaps))], label=r["target"])
    ax.set(xlabel="inter-token latency (ms)", ylabel="fraction of gaps", xscale="log",
           title=f"ITL CDF at {cdf_rate:g} req/s")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out_dir / "itl_cdf.png", dpi=100)
    plt.close(fig)
