"""Start-up time of `pdserve serve` on the `small` model: from the command to a healthy /health.

    .venv/bin/python bench/startup.py [--model DIR] [--repeats 3] [--tp 1]

Target: under 10 s. Each run is a fresh process (imports, weights, KV cache, NIXL agent, engine).
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

from pdserve.cli import ensure_model  # noqa: E402
from pdserve.launcher import Instance  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "startup.json"))
    args = ap.parse_args()
    model = ensure_model(args.model)
    logs = Path(tempfile.mkdtemp(prefix="pdserve-startup-"))
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        inst = Instance("server", ["serve", model, "--port", "0", "--tensor-parallel-size", str(args.tp)])
        inst.spawn(logs).wait_healthy(120)
        times.append(time.perf_counter() - start)
        inst.stop()
    result = {"tp": args.tp, "seconds": [round(t, 2) for t in times],
              "median_s": round(statistics.median(times), 2), "target_s": 10}
    print(f"pdserve serve (small, TP {args.tp}) to healthy: median {result['median_s']} s "
          f"{result['seconds']} (target < 10 s)")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
