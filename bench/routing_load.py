"""TTFT as the load rises: routing policies side by side on `bench/routing.py`'s trace and 4P4D mock
instances, at several engine speeds. `--mock-speedup 0.25` makes every step 4x slower, so the same
arrivals are 4x the load: at 1 the prompts hardly queue, at 0.2 the producers run near saturation.

    .venv/bin/python bench/routing_load.py [--speedups 0.5,0.3,0.25,0.2] [--policies kv-aware,least-loaded]

Per load and policy: the prefix hit rate, TTFT p50 / p90 and each policy's TTFT over kv-aware's;
what the caches save counts for more as the queues grow. One run per point: on this machine a rerun
of one point has moved TTFT by up to ~20 %.
Results: bench/results/routing_load.json and .png.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from routing import NUM_BLOCKS, ROOT, run_policy  # noqa: E402

from pdserve.bench.trace import conversation_trace  # noqa: E402
from pdserve.cli import ensure_model  # noqa: E402


def plot(out: dict, path: Path) -> None:
    """TTFT p90 per policy against the load, and each policy's p50 and p90 over kv-aware's."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    points = out["points"]
    load = [1 / p["speedup"] for p in points]
    fig, (ttft, ratio) = plt.subplots(1, 2, figsize=(10, 3.6))
    for i, policy in enumerate(out["policies"]):  # a colour per policy: p90 solid, p50 dotted
        ttft.plot(load, [p["results"][policy]["ttft_p90_ms"] for p in points], "o-", color=f"C{i}",
                  label=f"{policy} p90")
        ttft.plot(load, [p["results"][policy]["ttft_p50_ms"] for p in points], "o:", color=f"C{i}",
                  label=f"{policy} p50")
        if policy != "kv-aware":
            ratio.plot(load, [p["ttft_p90_over_kv_aware"][policy] for p in points], "o-", color=f"C{i}",
                       label=f"{policy} p90")
            ratio.plot(load, [p["ttft_p50_over_kv_aware"][policy] for p in points], "o:", color=f"C{i}",
                       label=f"{policy} p50")
    ttft.set_yscale("log")
    ttft.set_xlabel("load (1 / --mock-speedup)")
    ttft.set_title("TTFT (ms)")
    ttft.legend(fontsize=7)
    ratio.axhline(2, color="k", lw=0.8, ls="--")
    ratio.set_xlabel("load (1 / --mock-speedup)")
    ratio.set_title("TTFT over kv-aware's")
    ratio.legend(fontsize=7)
    fig.suptitle(f"4P4D mock instances, {out['rows']}-request conversation trace", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--speedups", default="0.5,0.3,0.25,0.2")
    p.add_argument("--policies", default="kv-aware,least-loaded", help="comma-separated, kv-aware first")
    p.add_argument("--rows", type=int, default=800)
    p.add_argument("--num-blocks", type=int, default=NUM_BLOCKS, help="KV blocks per instance")
    p.add_argument("--time-scale", type=float, default=1.0, help="--trace-time-scale")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "routing_load.json"))
    args = p.parse_args()
    policies = args.policies.split(",")
    model = ensure_model(None)
    work = Path(tempfile.mkdtemp(prefix="pdserve-routing-load-"))
    trace = work / "trace.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in conversation_trace(args.rows, args.seed)))
    points = []
    for speedup in (float(s) for s in args.speedups.split(",")):
        point_args = argparse.Namespace(**{**vars(args), "speedup": speedup})
        results = {policy: run_policy(model, policy, trace, point_args, work) for policy in policies}
        kv = results["kv-aware"]
        points.append({"speedup": speedup, "results": results, **{
            f"ttft_{q}_over_kv_aware": {policy: round(r[f"ttft_{q}_ms"] / kv[f"ttft_{q}_ms"], 2)
                                        for policy, r in results.items() if policy != "kv-aware"}
            for q in ("p50", "p90")}})
        print(f"speedup {speedup:g}: " + "; ".join(
            f"{policy} hit {r['prefix_hit_rate']:.3f} TTFT p50/p90 {r['ttft_p50_ms']:.0f}/{r['ttft_p90_ms']:.0f} ms"
            for policy, r in results.items()) + f"; p90 over kv-aware {points[-1]['ttft_p90_over_kv_aware']}",
            flush=True)
    out = {"rows": args.rows, "time_scale": args.time_scale, "num_blocks_per_instance": args.num_blocks,
           "policies": policies, "points": points}
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    plot(out, Path(args.out).with_suffix(".png"))
    print(f"trace, bench results and placement logs: {work}")


if __name__ == "__main__":
    main()
