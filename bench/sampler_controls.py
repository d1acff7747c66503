"""What the sampling controls cost rank 0's sampler per step at batch 8, over SmolLM2's vocabulary
(49,152): no controls against the sampler before them (git revision `--before`), and with penalties
or every control on some or all rows.

    .venv/bin/python bench/sampler_controls.py [--before fe7ac40^] [--calls 300]

One thread and rank 0's allocator settings, random logits; each sample() call is one decode step's sampling. A request's history is
a 500-token prompt and 100 generated tokens. Median microseconds per call, interleaved rounds.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402

from pdserve.worker.messages import LogitsControls, SamplingSpec  # noqa: E402
from pdserve.worker.sampler import Sampler  # noqa: E402
from pdserve.worker.worker import tune_allocator  # noqa: E402

VOCAB, BATCH = 49_152, 8
PENALTIES = dict(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.2)


def history(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return dict(prompt_token_ids=torch.randint(0, VOCAB, (500,), generator=g).tolist(),
                output_token_ids=torch.randint(0, VOCAB, (100,), generator=g).tolist())


def every_control(seed: int) -> LogitsControls:
    g = torch.Generator().manual_seed(seed)
    return LogitsControls(**PENALTIES, **history(seed), min_tokens=200, min_tokens_stop_ids=[2],
                          logit_bias=[(t, 1.0) for t in torch.randint(0, VOCAB, (10,), generator=g).tolist()],
                          allowed_token_ids=torch.randint(0, VOCAB, (1000,), generator=g).unique().tolist(),
                          bad_words_token_ids=[[5, 6], [7], [8, 9, 10]])


def spec(temperature: float, controls: LogitsControls | None = None) -> SamplingSpec:
    kw = {} if controls is None else {"controls": controls}
    return SamplingSpec(temperature=temperature, top_p=0.95 if temperature else 1.0, top_k=0, seed=None,
                        num_logprobs=None, **kw)


def load_before(rev: str):
    """The sampler module as it was at `rev` (its imports resolve against today's package)."""
    source = subprocess.run(["git", "show", f"{rev}:src/pdserve/worker/sampler.py"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout
    path = Path(tempfile.mkdtemp()) / "sampler_before.py"
    path.write_text(source)
    module_spec = importlib.util.spec_from_file_location("sampler_before", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module.Sampler


def make(sampler_cls, temperature: float, controlled: int, controls) -> tuple:
    s = sampler_cls(VOCAB)
    ids = [f"r{i}" for i in range(BATCH)]
    for i, rid in enumerate(ids):
        s.add(rid, spec(temperature, controls(i) if i < controlled else None))
    return s, ids


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", default="fe7ac40^", help="git revision of the sampler without controls")
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--out", default=str(ROOT / "bench/results/sampler_controls.json"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    tune_allocator()  # as rank 0 runs: freed batches stay in the heap (no page faults per step)
    before = load_before(args.before)
    penalties = lambda i: LogitsControls(**PENALTIES, **history(i))  # noqa: E731
    cases = {}
    for temperature, mode in ((0.0, "greedy"), (0.8, "sampled")):
        cases[f"{mode}, before"] = make(before, temperature, 0, None)
        cases[f"{mode}, no controls"] = make(Sampler, temperature, 0, None)
        cases[f"{mode}, 1 of 8 with penalties"] = make(Sampler, temperature, 1, penalties)
        cases[f"{mode}, 8 with penalties"] = make(Sampler, temperature, BATCH, penalties)
        cases[f"{mode}, 8 with every control"] = make(Sampler, temperature, BATCH, every_control)
    logits = torch.randn(BATCH, VOCAB) * 4
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.calls):
        for name, (s, ids) in cases.items():
            start = time.perf_counter()
            s.sample(logits, ids)
            times[name].append(time.perf_counter() - start)
    result = {name: round(statistics.median(t) * 1e6, 1) for name, t in times.items()}
    print(f"sampler.sample() at batch {BATCH}, vocab {VOCAB}, 1 thread: median us per call")
    for name, us in result.items():
        print(f"  {name:38s} {us:9.1f}")
    Path(args.out).write_text(json.dumps({"batch": BATCH, "vocab": VOCAB, "calls": args.calls,
                                          "before": args.before, "median_us": result}, indent=1) + "\n")


if __name__ == "__main__":
    main()
