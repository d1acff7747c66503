"""What each weight format costs in quality: perplexity on tests/data/prose.txt, the share of its
positions whose most likely next token is float32's, and free-running greedy answers against
float32's, on SmolLM2-135M (its Q4_1 GGUF file) and the generated `small` model.

    .venv/bin/python bench/quality.py [--only formats|kv] [--out bench/results/quality.json]

One thread, one model at a time. The text is scored in windows of 512 tokens. "greedy_prefix" is the
mean number of tokens a format's greedy answer shares with float32's before the first difference
(4 prompts from the text, 48 new tokens each). `kv`: float32 weights with each KV cache dtype,
the text prefilled 64 tokens at a time so every chunk reads the ones before it from the cache.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine import smollm2_file  # noqa: E402

from pdserve import LLM, SamplingParams  # noqa: E402
from pdserve.bench.quality import Scorer, agreement  # noqa: E402
from pdserve.checkpoints.gguf_file import checkpoint_dir  # noqa: E402
from pdserve.cli import ensure_model, pdserve_home  # noqa: E402
from pdserve.text.tokenizer import Tokenizer  # noqa: E402

TEXT = Path(__file__).resolve().parent.parent / "tests" / "data" / "prose.txt"
FORMATS = {"float32": ("float32", "none"), "bfloat16": ("bfloat16", "none"), "int8": ("float32", "int8"),
           "int4": ("float32", "int4")}
NEW_TOKENS = 48
KV_DTYPES = ("float32", "bfloat16", "float16", "fp8_e4m3")
KV_CHUNK = 64  # tokens per prefill chunk when measuring KV dtypes


def greedy(model_dir: str, dtype: str, quantization: str | None, prompts: list[list[int]],
           kv_cache_dtype: str = "auto") -> list[list[int]]:
    llm = LLM(model_dir, dtype=dtype, quantization=quantization, num_threads=1, num_blocks=256,
              kv_cache_dtype=kv_cache_dtype)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    finally:
        llm.shutdown()


def shared_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def measure(model_dir: str, gguf: bool) -> dict:
    tok = Tokenizer(model_dir)
    text = TEXT.read_text()
    ids = tok.encode(text)
    paragraphs = [p for p in text.split("\n\n") if len(p) > 200][1:5]
    prompts = [tok.encode(p)[:48] for p in paragraphs]
    out = {"tokens": len(ids)}
    base = base_answers = None
    for name, (dtype, quantization) in FORMATS.items():
        if gguf and name == "int4":
            quantization = None  # the file's own formats: Q4_1 -> int4, its Q8_0 table -> int8
        score = Scorer(model_dir, dtype, quantization).score(ids)
        answers = greedy(model_dir, dtype, quantization, prompts)
        if base is None:
            base, base_answers = score, answers
        out[name] = {
            "quantization": quantization or "gguf", "dtype": dtype,
            "perplexity": round(score.perplexity, 3),
            "vs_float32": round(score.perplexity / base.perplexity - 1, 4),
            "top1_agreement": round(agreement(score, base), 4),
            "greedy_prefix": round(sum(shared_prefix(a, b) for a, b in zip(answers, base_answers)) / len(prompts), 1)}
        print(f"  {name:8} ppl {score.perplexity:10.3f} ({out[name]['vs_float32']:+.2%}) top-1 agreement "
              f"{out[name]['top1_agreement']:.1%} greedy prefix {out[name]['greedy_prefix']}/{NEW_TOKENS}",
              flush=True)
    return out


def measure_kv(model_dir: str) -> dict:
    """Float32 weights, each KV cache dtype: the text prefilled in chunks of KV_CHUNK tokens, each
    reading the earlier ones from the cache as stored, and greedy answers (whose decode steps read it)."""
    tok = Tokenizer(model_dir)
    text = TEXT.read_text()
    ids = tok.encode(text)
    prompts = [tok.encode(p)[:48] for p in [p for p in text.split("\n\n") if len(p) > 200][1:5]]
    out = {"tokens": len(ids), "chunk_tokens": KV_CHUNK}
    base = base_answers = None
    for name in KV_DTYPES:
        score = Scorer(model_dir, "float32", "none", kv_cache_dtype=name, chunk_tokens=KV_CHUNK).score(ids)
        answers = greedy(model_dir, "float32", "none", prompts, kv_cache_dtype=name)
        if base is None:
            base, base_answers = score, answers
        out[name] = {
            "perplexity": round(score.perplexity, 3), "vs_float32": round(score.perplexity / base.perplexity - 1, 4),
            "top1_agreement": round(agreement(score, base), 4),
            "greedy_prefix": round(sum(shared_prefix(a, b) for a, b in zip(answers, base_answers)) / len(prompts), 1)}
        print(f"  kv {name:9} ppl {score.perplexity:10.3f} ({out[name]['vs_float32']:+.2%}) top-1 agreement "
              f"{out[name]['top1_agreement']:.1%} greedy prefix {out[name]['greedy_prefix']}/{NEW_TOKENS}", flush=True)
    return out


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "quality.json"))
    parser.add_argument("--only", choices=["formats", "kv"], default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    models = {"SmolLM2-135M-Instruct.Q4_1.gguf": (checkpoint_dir(smollm2_file(), pdserve_home() / "gguf"), True),
              "generated small": (ensure_model(None, "small"), False)}
    out = Path(args.out)
    previous = json.loads(out.read_text()) if out.is_file() else {}
    results = {**previous, "text": str(TEXT.relative_to(TEXT.parent.parent.parent)), "window": 512}
    for name, (model_dir, gguf) in models.items():
        print(name, flush=True)
        if args.only != "kv":
            results[name] = measure(model_dir, gguf)
        if args.only != "formats":
            results.setdefault("kv_cache_dtype", {})[name] = measure_kv(model_dir)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
