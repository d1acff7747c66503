"""What a JSON-schema grammar adds to a decode step: batch 8, every request constrained, against the
same batch unconstrained (target: at most +10 %).

    .venv/bin/python bench/structured.py [--new-tokens 64]

One engine per model (the generated tiny model, where a step is cheapest and the grammar's share
largest, and SmolLM2-135M Q4_1), one thread. Both runs decode the same number of steps: `ignore_eos`,
and a schema whose one string field the model may fill to the end. Median step time over the decode
steps of 3 runs each, interleaved.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from pdserve import LLM, SamplingParams  # noqa: E402
from pdserve.sampling_params import StructuredOutputs  # noqa: E402

SCHEMA = {"type": "object", "properties": {"id": {"type": "integer"}, "text": {"type": "string"}},
          "required": ["id", "text"], "additionalProperties": False}
BATCH = 8


def step_times(llm: LLM, structured: StructuredOutputs | None, new_tokens: int, tag: str) -> list[float]:
    engine = llm.engine
    params = SamplingParams(temperature=1.0, seed=0, max_tokens=new_tokens, ignore_eos=True, structured=structured)
    for i in range(BATCH):
        engine.add_request(f"{tag}-{i}", llm.tokenizer.encode(f"Request {i}: describe a record as JSON."), params)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.requests.values()):
        engine.step()  # prefill (and the first token) is not decode
    times = []
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    return times[:-1]  # the last step may run fewer rows


def measure(model: str, new_tokens: int) -> dict:
    llm = LLM(model, num_threads=1, num_blocks=1024)
    grammar = StructuredOutputs("json", json.dumps(SCHEMA))
    step_times(llm, grammar, 8, "warm-g")  # the tokenizer's preparation and the schema's compile
    step_times(llm, None, 8, "warm")
    free, constrained = [], []
    for run in range(3):
        free += step_times(llm, None, new_tokens, f"free-{run}")
        constrained += step_times(llm, grammar, new_tokens, f"json-{run}")
    llm.shutdown()
    f, c = statistics.median(free), statistics.median(constrained)
    return {"batch": BATCH, "step_ms_free": round(f * 1e3, 3), "step_ms_json_schema": round(c * 1e3, 3),
            "overhead_pct": round((c / f - 1) * 100, 1), "steps_each": len(free)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "structured.json"))
    args = ap.parse_args()
    from engine import smollm2_file

    from pdserve.bench.machine import busy_cores

    from pdserve.model.tiny import make_model
    models = {"tiny": str(make_model(Path(tempfile.mkdtemp()) / "tiny", "tiny")), "smollm2": smollm2_file()}
    results = {"library": "llguidance", "busy_cores_before": busy_cores(), "target_overhead_pct": 10}
    for name, path in models.items():
        results[name] = measure(path, args.new_tokens)
        print(name, results[name], flush=True)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
