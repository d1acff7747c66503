"""bench/multiturn.py's summary: medians per turn over the conversations, new ÷ old ratios, the
issue's targets checked, and the printed table. Pure: takes the recorded turns, returns dicts."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

# issue 20's targets, from turn 2 on
TTFT_RATIO_TARGET = {"a": 0.7, "b": 0.3}
FIELDS = ("ttft_ms", "tt2t_ms", "e2e_ms", "decode_blocks_read", "decode_blocks_lacked",
          "decode_blocks_from_bytes", "decode_blocks_read_skipped", "producer_prompt_tokens_computed",
          "user_tokens", "producer_prefix_cache_hits", "decode_prefix_cache_hits", "producer_blocks_pulled",
          "producer_blocks_from_bytes")


def bytes_per_block(model: str, block_size: int) -> int:
    """K and V of one block over every layer: what a READ of one block moves (TP 1 to TP 1)."""
    c = json.loads((Path(model) / "config.json").read_text())
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    size = {"float32": 4, "bfloat16": 2, "float16": 2}[c.get("torch_dtype", "float32")]
    return 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * head_dim * block_size * size


def flatten(r: dict, block_bytes: int) -> dict:
    d, p = r["decode"], r["producer"]
    return {**{k: r[k] for k in ("ttft_ms", "tt2t_ms", "e2e_ms", "decode_blocks_lacked", "user_tokens")},
            "decode_blocks_read": d["blocks_read"], "decode_blocks_read_skipped": d["blocks_read_skipped"],
            "decode_bytes_read": d["bytes_read"],
            "decode_blocks_from_bytes": None if d["bytes_read"] is None else d["bytes_read"] / block_bytes,
            "producer_prompt_tokens_computed": p["prompt_tokens_computed"],
            "producer_prefix_cache_hits": p["prefix_cache_hits"], "decode_prefix_cache_hits": d["prefix_cache_hits"],
            "producer_blocks_pulled": p["blocks_pulled"],
            "producer_blocks_from_bytes": None if p["bytes_read"] is None else p["bytes_read"] / block_bytes}


def median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return round(statistics.median(values), 1) if values else None


def summarize(runs: dict, model: str, block_size: int) -> dict:
    block_bytes = bytes_per_block(model, block_size)
    for modes in runs.values():
        for convs in modes.values():
            for records in convs:
                for r in records:
                    r.update(flatten(r, block_bytes))
    medians = {code: {mode: [{"turn": i + 1, **{f: median([conv[i][f] for conv in convs]) for f in FIELDS}}
                             for i in range(len(convs[0]))] for mode, convs in modes.items() if convs}
               for code, modes in runs.items()}
    decisions = {code: {mode: _count(r["pd_decision"] for records in convs for r in records)
                        for mode, convs in modes.items()} for code, modes in runs.items()}
    out = {"bytes_per_block": block_bytes, "pd_decisions": decisions, "medians": medians}
    if "old" in medians:
        out["ratios_new_over_old"] = {mode: {f"turn{t['turn']}_{f}": _ratio(t[f], o[f])
                                             for t, o in zip(medians["new"][mode], medians["old"][mode])
                                             for f in ("ttft_ms", "tt2t_ms", "e2e_ms")}
                                      for mode in medians["new"]}
    out["targets"] = targets(runs, out, block_size)
    return out


def _count(values) -> dict:
    counts: dict = {}
    for v in values:
        counts[str(v)] = counts.get(str(v), 0) + 1
    return counts


def _ratio(a, b):
    return None if a is None or not b else round(a / b, 3)


def targets(runs: dict, summary: dict, block_size: int) -> dict:
    """The issue's targets, each met or not (None: not measurable in this run)."""
    later = [r for convs in runs["new"].values() for records in convs for r in records if r["turn"] >= 2]
    t = {"decode_reads_exactly_what_it_lacked": all(r["pd_decision"] == "remote"
                                                    and r["decode_blocks_read"] == r["decode_blocks_lacked"]
                                                    and r["decode_blocks_from_bytes"] == r["decode_blocks_lacked"]
                                                    for r in later),
         "producer_computes_new_tokens_plus_at_most_a_block": all(
             r["producer_prompt_tokens_computed"] <= r["user_tokens"] + block_size for r in later)}
    ratios = summary.get("ratios_new_over_old")
    for mode, limit in TTFT_RATIO_TARGET.items():
        if ratios is None:
            t[f"last_turn_ttft_ratio_{mode}_at_most_{limit}"] = None
            continue
        last = max(int(k[4:].split("_")[0]) for k in ratios[mode])
        value = ratios[mode][f"turn{last}_ttft_ms"]
        t[f"last_turn_ttft_ratio_{mode}_at_most_{limit}"] = None if value is None else value <= limit
    return t


def report(results: dict) -> None:
    def cell(v):
        return "n/a" if v is None else (f"{v:.0f}" if isinstance(v, float) else str(v))
    head = ("turn", "TTFT ms", "2nd tok ms", "e2e ms", "D read", "D lacked", "D read (bytes)",
            "P pulled", "P pulled (bytes)", "P computed", "P hits", "D hits")
    keys = ("turn", "ttft_ms", "tt2t_ms", "e2e_ms", "decode_blocks_read", "decode_blocks_lacked",
            "decode_blocks_from_bytes", "producer_blocks_pulled", "producer_blocks_from_bytes",
            "producer_prompt_tokens_computed", "producer_prefix_cache_hits", "decode_prefix_cache_hits")
    for code, modes in results["medians"].items():
        for mode, turns in modes.items():
            info = results["code"][code]
            print(f"\n{code} ({info['commit']}), mode {mode}: medians over {results['conversations']} "
                  f"conversations (blocks of {results['block_size']} tokens, hits in tokens)")
            print(" | ".join(head))
            for t in turns:
                print(" | ".join(cell(t[k]) for k in keys))
    for mode, ratios in results.get("ratios_new_over_old", {}).items():
        last = results["turns"]
        print(f"mode {mode}, turn {last} new / old: TTFT {ratios[f'turn{last}_ttft_ms']}, 2nd token "
              f"{ratios[f'turn{last}_tt2t_ms']}, e2e {ratios[f'turn{last}_e2e_ms']} "
              f"(target TTFT <= {TTFT_RATIO_TARGET[mode]}); turn 1, the same work in both codes (the "
              f"run's noise floor): TTFT {ratios['turn1_ttft_ms']}, e2e {ratios['turn1_e2e_ms']}")
    print(f"proxy decisions (X-PD-Decision): {results['pd_decisions']}")
    mismatches = results["greedy_mismatches"]
    print(f"greedy answers equal colocated: {'all' if not mismatches else f'{len(mismatches)} mismatches'}")
    for name, met in results["targets"].items():
        print(f"  {name}: {'n/a' if met is None else 'met' if met else 'NOT met'}")
