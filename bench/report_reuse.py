"""README lines for the reuse and routing benchmarks (multiturn, pull_breakeven, kv_events,
index_exactness, routing, routing_speedup03, routing_multiturn, proxy_tokenize), called by bench/report.py."""

from __future__ import annotations


def multiturn(r: dict, kv_aware: dict | None) -> list[str]:
    new, old = r["medians"]["new"], r["medians"]["old"]
    ratio = r["ratios_new_over_old"]
    t = r["turns"]
    lines = [f"**Multi-turn reuse** (`bench/multiturn.py`, {r['conversations']} conversations of {t} turns through "
             f"1P1D: a {r['system_tokens']}-token system prompt, {r['user_tokens']}-token turns and answers; every "
             f"turn through P/D; `{r['code']['new']['commit']}` beside `{r['code']['old']['commit']}`, the code "
             "before reuse, in the same run; medians):", "",
             "| turn | TTFT ms new / old | blocks decode READ (of what it lacked) | prompt tokens the producer "
             "computed new / old | with the producer's cache reset: TTFT ms new / old | ... tokens computed new "
             "/ old (blocks pulled from decode) |", "|---|---|---|---|---|---|"]
    for a, b, oa, ob in zip(new["a"], new["b"], old["a"], old["b"]):
        lines.append(f"| {a['turn']} | {a['ttft_ms']:.0f} / {oa['ttft_ms']:.0f} | {a['decode_blocks_read']:.0f} "
                     f"({a['decode_blocks_lacked']:.0f}) | {a['producer_prompt_tokens_computed']:.0f} / "
                     f"{oa['producer_prompt_tokens_computed']:.0f} | {b['ttft_ms']:.0f} / {ob['ttft_ms']:.0f} | "
                     f"{b['producer_prompt_tokens_computed']:.0f} / {ob['producer_prompt_tokens_computed']:.0f} "
                     f"({b['producer_blocks_pulled']:.0f}) |")
    lines += ["", f"Turn-{t} TTFT new ÷ old: {ratio['a'][f'turn{t}_ttft_ms']} (target ≤ 0.7), with the producer's "
                  f"cache reset {ratio['b'][f'turn{t}_ttft_ms']} (target ≤ 0.3); turn 1, the same work in both "
                  f"codes: {ratio['a']['turn1_ttft_ms']} and {ratio['b']['turn1_ttft_ms']}. Greedy answers equal a "
                  f"colocated instance's: {'all' if not r['greedy_mismatches'] else 'not all'}."]
    if kv_aware:
        k = kv_aware["ratios_new_over_old"]
        lines.append(f"With pdserve's default routing (`--routing kv-aware`: decode holds each turn's history and "
                     f"prefills the rest itself), turn-{t} TTFT new ÷ old is {k['a'][f'turn{t}_ttft_ms']}, and "
                     f"{k['b'][f'turn{t}_ttft_ms']} with the producer's cache reset.")
    return lines


def pull_breakeven(r: dict) -> list[str]:
    cells = ", ".join(f"{row['pulled_tokens']} tokens {row['ttft_ms_pull']:.0f} vs {row['ttft_ms_compute']:.0f} ms"
                      for row in r["rows"])
    return [f"Pulling the history from decode against computing it (`bench/pull_breakeven.py`, second-turn TTFT, "
            f"median of {r['repeats']}): {cells}; pulling wins from {r['breakeven_pulled_tokens']} tokens "
            "(the producer's `--kv-pull-min-tokens` default is 64)."]


def kv_events(r: dict) -> list[str]:
    runs = "; ".join(f"{x['scenario']}: {x['batches_dropped']} of {x['batches_received']} batches lost, exact again "
                     f"{x['time_to_exact_ms']} ms after the run ({x['snapshots']} snapshot(s))" for x in r["runs"])
    return [f"KV events (`bench/kv_events.py`, {r['drop_fraction']:.0%} of batches dropped, evictions): {runs} "
            f"(target: exact within {r['target_s']:g} s)."]


def index_exactness(r: dict) -> list[str]:
    points = r["checkpoints"]
    exact = [c for c in points if c["exact"]]
    slowest = max((c["time_to_exact_ms"] for c in exact), default=None)
    return [f"The proxy's KV index (`bench/index_exactness.py`, 2P2D `--mock-engine`, {r['num_blocks_per_instance']} "
            f"blocks per instance, {r['drop_fraction']:.0%} of every instance's batches lost in the proxy, 4 trace "
            "phases, a decode and a producer killed and restarted, two caches reset): equal to the union of the "
            f"instances' caches at {len(exact)} of {len(points)} quiescent checkpoints"
            + (f", each within {slowest:g} ms of quiescence" if slowest is not None else "")
            + f"; {r['batches_dropped']} of {r['batches_received']} batches lost, {r['snapshots']} snapshot(s) "
            "(target: exact at every checkpoint)."]


def routing(r: dict) -> list[str]:
    lines = [f"**Routing** (`bench/routing.py`, 4P4D `--mock-engine` ×{r['speedup']:g}, a {r['rows']}-request "
             f"conversation trace, {r['num_blocks_per_instance']} blocks per instance; `least-loaded/no-pulls`: "
             "producers never claim blocks elsewhere, each instance reuses only its own cache, as behind a "
             "cache-blind router):", "",
             "| policy | prefix hit rate (one LRU cache of all blocks) | busiest ÷ mean prompt tokens computed, "
             "prefill / decode | P/D decisions local / remote | TTFT p50 / p90 ms | ITL p99 ms |",
             "|---|---|---|---|---|---|"]
    for x in r["results"]:
        b, d = x["busiest_over_mean"], x.get("decisions", {})
        lines.append(f"| {x['policy']} | {x['prefix_hit_rate']:.1%} ({x['lru_bound_hit_rate']:.1%}) | "
                     f"{b['prefill']} / {b['decode'] if b['decode'] is not None else '-'} | "
                     f"{d.get('local', 0):.0f} / {d.get('remote', 0):.0f} | "
                     f"{x['ttft_p50_ms']:.0f} / {x['ttft_p90_ms']:.0f} | "
                     + ("n/a" if x.get("itl_p99_ms") is None else f"{x['itl_p99_ms']:.0f}") + " |")
    s = r["summary"]
    p90 = ", ".join(f"{k} {v}×" for k, v in s.get("ttft_p90_over_kv_aware", {}).items())
    by = {x["policy"]: x for x in r["results"]}
    more = (f"{(1 - by['least-loaded/no-pulls']['prefix_hit_rate']) / (1 - by['least-loaded']['prefix_hit_rate']) - 1:.0%} "
            "more") if "least-loaded" in by and "least-loaded/no-pulls" in by else "more"
    kv, both, gap = by["kv-aware"], by.get("kv-aware/both-copies", {}), ""
    if kv.get("copies_per_cached_block"):
        gap = (f" When kv-aware placed a request, some instance held {kv['cached_anywhere_rate']:.1%} of its prompt "
               f"tokens and {kv['prefix_hit_rate']:.1%} were reused: what is lost to the bound is what the caches "
               f"hold, not how requests use it. At the end each cached block was cached on "
               f"{kv['copies_per_cached_block']} instances on average (a shared system prompt on each instance "
               "serving its conversations), where one LRU cache holds it once; running requests' blocks and "
               "answers this trace never repeats also take room one LRU cache does not count.")
        if both.get("copies_per_cached_block"):
            gap += (f" Keeping both copies of each prompt ({both['copies_per_cached_block']} instances per cached "
                    f"block) reuses {both['prefix_hit_rate']:.1%}.")
    lines += ["", f"kv-aware reaches {s['hit_rate_over_lru_bound']} of the LRU bound (target ≥ 0.9); busiest ÷ mean "
                  f"{s['kv_aware_busiest_over_mean']} (target ≤ 1.15); TTFT p90 over kv-aware's: {p90} (target ≥ 2 "
                  f"for least-loaded).{gap} Least-loaded "
                  "routes blind to the caches, but its producers still claim what decode instances hold (the proxy "
                  "names them, least loaded first, not knowing what they cache); without that (`no-pulls`) it "
                  f"computes {more} prompt tokens.",
              "", "![routing policies side by side](bench/results/routing.png)"]
    return lines


def routing_speedup03(r: dict) -> list[str]:
    """The same trace on engines 1/0.3 as fast (`--speedup 0.3`): a load where prompts queue."""
    by = {x["policy"]: x for x in r["results"]}
    kv = by["kv-aware"]
    rows = "; ".join(f"{p} {x['prefix_hit_rate']:.1%}, {x['ttft_p50_ms']:.0f} / {x['ttft_p90_ms']:.0f} ms"
                     for p, x in by.items())
    p90 = ", ".join(f"{k} {v}×" for k, v in r["summary"].get("ttft_p90_over_kv_aware", {}).items())
    return [f"Under load (`bench/routing.py --speedup {r['speedup']:g} --policies {','.join(by)} --out "
            f"bench/results/routing_speedup03.json`: every engine "
            f"{1 / r['speedup']:.1f}× slower), hit rate and TTFT p50 / p90: {rows}. TTFT p90 over kv-aware's: {p90}; "
            f"kv-aware's hit rate {kv['prefix_hit_rate'] / kv['lru_bound_hit_rate']:.3f} of the LRU bound. Against a "
            "cache-blind deployment the queues make the computed tokens count; pdserve's own least-loaded is "
            "helped by its producers' pulls."]


def routing_load(r: dict, rerun: dict | None = None) -> list[str]:
    """TTFT as the load rises (bench/routing_load.py): one row per engine speed; `rerun`: the same
    command again at some of those speeds, to show how much one point moves."""
    policies = r["policies"]
    others = [p for p in policies if p != "kv-aware"]
    lines = ["**Routing as the load rises** (`bench/routing_load.py`: the same trace and 4P4D mock instances, "
             "every engine 1/speedup as fast; one run per point). Hit rate, TTFT p50 / p90 ms; ITL p99 ms per "
             "policy; kv-aware's decisions (local: a decode instance prefilled the turn itself):", "",
             "| speedup | " + " | ".join(policies) + " | " + " | ".join(f"{p} ÷ kv-aware, p50 / p90" for p in others)
             + " | ITL p99 | kv-aware local / remote |", "|---" * (3 + len(policies) + len(others)) + "|"]
    for point in r["points"]:
        results = [point["results"][p] for p in policies]
        cells = [f"{x['prefix_hit_rate']:.1%}, {x['ttft_p50_ms']:.0f} / {x['ttft_p90_ms']:.0f}" for x in results]
        ratios = [f"{point['ttft_p50_over_kv_aware'][p]}× / {point['ttft_p90_over_kv_aware'][p]}×" for p in others]
        itl = " / ".join("n/a" if x.get("itl_p99_ms") is None else f"{x['itl_p99_ms']:.0f}" for x in results)
        decided = point["results"]["kv-aware"].get("decisions") or {}
        cells += ratios + [itl, f"{decided.get('local', 0):.0f} / {decided.get('remote', 0):.0f}" if decided else "n/a"]
        lines.append(f"| {point['speedup']:g} | " + " | ".join(cells) + " |")
    met = [f"{point['speedup']:g}" for point in r["points"]
           if all(v >= 2 for v in point["ttft_p90_over_kv_aware"].values())]
    lines += ["", f"Least-loaded's TTFT p90 at least 2× kv-aware's (the target) at speedup {', '.join(met) if met else 'none'}: "
              "where the queues grow, the ~1.1-1.2× prompt tokens least-loaded computes compound, and kv-aware's "
              "decode instances that run no stream prefill turns off the busy producers' queues; with little "
              "queueing TTFT follows the tokens on the critical path. One point's TTFT moves by up to ~20 % "
              "between runs here, the ratio of two by up to ~30 %"
              + (": run again (bench/results/routing_load_rerun.json), least-loaded's TTFT p90 over kv-aware's was "
                 + ", ".join(f"{v}× at speedup {point['speedup']:g}" for point in rerun["points"]
                             for v in point["ttft_p90_over_kv_aware"].values()) if rerun else "") + "."]
    bound = [(point["speedup"], point["results"]["kv-aware"]) for point in r["points"]]
    if all(x.get("lru_bound_hit_rate") for _, x in bound):
        lines += ["", "kv-aware's hit rate over the LRU bound (target ≥ 0.9): " + ", ".join(
            f"{x['prefix_hit_rate'] / x['lru_bound_hit_rate']:.3f} at speedup {s:g}" for s, x in bound)
            + "; busiest ÷ mean, prefill / decode (target ≤ 1.15): " + ", ".join(
            f"{x['busiest_over_mean']['prefill']} / {x['busiest_over_mean']['decode']}" for _, x in bound) + "."]
        again = f" (run again: {', '.join(all_met(rerun)) or 'none'})" if rerun else ""
        lines += ["", f"All three trace targets in one replay (hit rate, balance, least-loaded's TTFT p90 ≥ 2× kv-aware's): "
                  f"{', '.join(all_met(r)) or 'none'}{again}."]
    return lines + ["", "![TTFT as the load rises](bench/results/routing_load.png)"]


def all_met(r: dict) -> list[str]:
    """The speeds at which one replay met every trace target of the routing issue: kv-aware's hit
    rate ≥ 0.9 of one LRU cache of all the blocks, the busiest instance of each pool ≤ 1.15× the
    mean, and least-loaded's TTFT p90 ≥ 2× kv-aware's."""
    out = []
    for point in r["points"]:
        kv = point.get("results", {}).get("kv-aware")
        if kv and kv.get("lru_bound_hit_rate") and kv["prefix_hit_rate"] >= 0.9 * kv["lru_bound_hit_rate"] \
                and all(v <= 1.15 for v in kv["busiest_over_mean"].values()) \
                and point["ttft_p90_over_kv_aware"].get("least-loaded", 0) >= 2:
            out.append(f"speedup {point['speedup']:g}")
    return out


def routing_multiturn(r: dict) -> list[str]:
    lines = [f"**Multi-turn routing on real instances** (`bench/routing_multiturn.py`, 1P2D `small`, "
             f"{r['sessions']} sessions of {r['turns']} turns: {r['system']}-token system prompt, {r['user']}-token "
             f"turns, {r['answer']}-token answers, 1 s think time):", "",
             "| sessions/s | policy | TTFT p50 / p90 ms | ITL p99 ms | history from cache | decisions local / remote |",
             "|---|---|---|---|---|---|"]
    for x in r["results"]:
        d = x["decisions"]
        itl = f"{x['itl_p99_ms']:.0f}" if "itl_p99_ms" in x else "-"
        lines.append(f"| {x['rate']:g} | {x['policy']} | {x['ttft_p50_ms']:.0f} / {x['ttft_p90_ms']:.0f} | {itl} | "
                     f"{x['history_from_cache']:.1%} | {d.get('local', 0):.0f} / {d.get('remote', 0):.0f} |")
    runs = f" (median TTFT p50 of {r['repeats']} runs each)" if r.get("repeats", 1) > 1 else ""
    lines += ["", "Targets: history from cache ≥ 95 % from the second turn; least-loaded's TTFT p50 ≥ 2× kv-aware's"
              + runs + ". " + "; ".join(f"{rate} sessions/s: {v['ttft_p50_least_loaded_over_kv_aware']}×"
                          for rate, v in sorted(r["summary"].items())) + "."]
    return lines


def proxy_tokenize(r: dict) -> list[str]:
    return [f"Tokenizing in the proxy (`bench/proxy_tokenize.py`, {r['tokenizer'].split('.')[0]}'s tokenizer, "
            f"~{r['prompt_tokens_p50']}-token chats of {r['turns']} turns, template included, p50): a conversation's "
            f"next turn {r['next_turn_p50_ms']} ms, a conversation never seen {r['new_conversation_p50_ms']} ms, "
            f"the whole text encoded at once {r['encode_whole_text_p50_ms']} ms (target < 1 ms)."]
