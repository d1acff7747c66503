"""The README's serving-sweep sections, rendered from `pdserve bench sweep` results (report.py)."""

from __future__ import annotations

from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def sweep(r) -> list[str]:
    table = (RESULTS / "sweep" / "sweep.md").read_text().strip().splitlines()
    return ["**Serving under load** (`pdserve bench sweep`, command above):", "", *table, "",
            *sweep_targets(r),
            "![TTFT against rate](bench/results/sweep/ttft.png) ![ITL against rate](bench/results/sweep/itl.png)",
            "![goodput against rate](bench/results/sweep/goodput.png) "
            "![ITL CDF](bench/results/sweep/itl_cdf.png)"]


def _runs(r) -> dict:
    """A sweep's runs by (target, rate)."""
    return {(x["target"], x["request_rate"]): x for x in r["runs"]}


def sweep_targets(r) -> list[str]:
    """The issue's targets, rate by rate: each P/D arrangement's goodput over the best colocated
    one's, and conditional P/D's TTFT p50 over the fastest colocated one's with its ITL p99 over its
    own ITL p50 at the lowest rate (the nearest this sweep has to unloaded)."""
    runs = _runs(r)
    colocated = [t for t in r["targets"] if t.startswith("colocated")]
    pds = [t for t in r["targets"] if t.startswith("pd")]
    cond = "pd-conditional" if "pd-conditional" in r["targets"] else None
    if not pds or not colocated or not cond:
        return []
    unloaded = runs[(cond, r["rates"][0])]["median_itl_ms"]
    out = ["| rate req/s | best colocated (share) | " + " | ".join(f"{t} goodput ÷ it" for t in pds) +
           " | conditional TTFT p50 ÷ fastest colocated | conditional ITL p99 ÷ its ITL p50 at "
           f"{r['rates'][0]:g} req/s |", "|---" * (len(pds) + 4) + "|"]
    for rate in r["rates"]:
        best = max((runs[(t, rate)] for t in colocated), key=lambda x: x["request_goodput"])
        cells = [f"{rate:g}", f"{best['target']} ({best['goodput_fraction']:.0%})"]
        for t in pds:
            x = runs[(t, rate)]
            cells.append(f"{x['request_goodput'] / best['request_goodput']:.2f} ({x['goodput_fraction']:.0%})"
                         if best["request_goodput"] else "∞")
        c = runs[(cond, rate)]
        fastest = min(runs[(t, rate)]["median_ttft_ms"] for t in colocated)
        cells += [f"{c['median_ttft_ms'] / fastest:.2f}", f"{c['p99_itl_ms'] / unloaded:.2f}"]
        out.append("| " + " | ".join(cells) + " |")
    return ["Against the targets (goodput ≥ 2× the best colocated arrangement wherever either serves at "
            "least half its requests within the SLOs; conditional TTFT p50 ≤ 1.3× colocated with ITL p99 "
            "≤ 2× unloaded):", "", *out, ""]


def sweep_fewer_bytes(fast, base) -> list[str]:
    """The README sweep again with every instance's weights int8 and KV bfloat16: goodput (share)
    and TTFT p50 per target and rate, beside the float32 sweep's."""
    runs, fast_runs = _runs(base), _runs(fast)
    out = ["**The same sweep with fewer bytes** (`--quantization int8 --kv-cache-dtype bfloat16` on every "
           "instance of every target, `bench/results/sweep_int8_bf16kv`; both within 1 % of float32's "
           "perplexity, `bench/quality.py`). Goodput req/s (share), TTFT p50 ms, ITL p99 ms; in brackets the float32 "
           "sweep's goodput:", "", "| target | " + " | ".join(f"{r:g} req/s" for r in fast["rates"]) + " |",
           "|---" * (len(fast["rates"]) + 1) + "|"]
    for t in fast["targets"]:
        cells = []
        for rate in fast["rates"]:
            x, b = fast_runs[(t, rate)], runs.get((t, rate))
            cells.append(f"{x['request_goodput']:.2f} ({x['goodput_fraction']:.0%}), {x['median_ttft_ms']:.0f}, "
                         f"{x['p99_itl_ms']:.0f} [{b['request_goodput']:.2f}]" if b else "")
        out.append(f"| {t} | " + " | ".join(cells) + " |")
    return out


def sweep_smollm2(r) -> list[str]:
    """The sweep's command on a real checkpoint (SmolLM2's Q4_1 GGUF as int4, bfloat16 KV)."""
    out = ["**The sweep on SmolLM2-135M-Instruct** (its GGUF's Q4_1 weights kept as int4, `--kv-cache-dtype "
           f"bfloat16`, the same targets and SLOs, {r['workload']['num_prompts']} prompts per rate, "
           "`bench/results/sweep_smollm2_int4_bf16kv`). Goodput req/s (share), TTFT p50 / p99 ms, ITL p99 ms:",
           "", "| target | " + " | ".join(f"{x:g} req/s" for x in r["rates"]) + " |",
           "|---" * (len(r["rates"]) + 1) + "|"]
    runs = _runs(r)
    for t in r["targets"]:
        cells = []
        for rate in r["rates"]:
            x = runs[(t, rate)]
            cells.append(f"{x['request_goodput']:.2f} ({x['goodput_fraction']:.0%}), {x['median_ttft_ms']:.0f} / "
                         f"{x['p99_ttft_ms']:.0f}, {x['p99_itl_ms']:.0f}")
        out.append(f"| {t} | " + " | ".join(cells) + " |")
    return out
