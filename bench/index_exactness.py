"""The proxy's KV index against the instances' caches (issue 21's target: exact at every quiescent
checkpoint of a replay with evictions, a restart and 1 % message loss).

    .venv/bin/python bench/index_exactness.py [--rows 48] [--num-blocks 64] [--drop 0.01] [--seed 0]

2 producers + 2 decode `--mock-engine` instances (the generated `tiny` model) behind a kv-aware
proxy whose followers lose 1 % of every instance's KV event batches (seeded; the proxy's
`--kv-events-drop-fraction`). Each instance holds `--num-blocks` blocks, far fewer than a phase
fills, so blocks are evicted all along. Four phases each replay a conversation trace (Mooncake's
format, shared system prompts, turns carrying their history; a seed of its own per phase) through
the proxy with `pdserve bench serve`'s client. Between phases a decode instance is killed and
restarted at its port, then a producer's cache is reset (`POST /reset_prefix_cache`); during the
third phase the other decode instance's cache is reset under load; before the fourth a producer is
killed and restarted. At each checkpoint, once every instance is idle, the set of (instance, block
hash) in the proxy's index (`GET /kv/index?hashes=true`) is compared with the union of what the
instances' pools hold (`GET /debug/kv_cached_hashes`), polled for up to 2 s. Beside it, what the
proxy's followers did since the previous checkpoint (`/kv/index`'s `repairs`): batches received,
dropped, gaps found, batches replayed, snapshots loaded. A follower checks a stream quiet for
100 ms by replay, and that replay may return a batch still on its way: such "gaps" are counted too,
though nothing was lost (the PUB copy arrives as a duplicate). Results:
bench/results/index_exactness.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from pdserve.bench import serve  # noqa: E402
from pdserve.bench.machine import busy_cores  # noqa: E402
from pdserve.bench.trace import conversation_trace  # noqa: E402
from pdserve.cli import ensure_model  # noqa: E402
from pdserve.launcher import Deployment, Instance  # noqa: E402

BLOCK_TOKENS = 32  # tokens per trace hash id: 2 KV blocks of 16
EXACT_WITHIN_S = 2.0  # how long a checkpoint polls for the index to become exact
REPAIRS = ("batches_received", "batches_dropped", "gaps", "batches_replayed", "snapshots")


def get(url: str, timeout_s: float = 10.0) -> dict:
    with urllib.request.urlopen(url, timeout=timeout_s) as r:
        return json.loads(r.read())


def post(url: str) -> dict:
    with urllib.request.urlopen(urllib.request.Request(url, b"", method="POST"), timeout=10) as r:
        return json.loads(r.read())


def replay(proxy: str, trace: list[dict], work: Path, name: str, time_scale: float) -> dict:
    """One phase: the trace through the proxy with `pdserve bench serve`'s client, in this process."""
    path = work / f"{name}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in trace))
    p = argparse.ArgumentParser()
    serve.add_arguments(p)
    args = p.parse_args(["--dataset-name", "trace", "--dataset-path", str(path), "--trace-block-tokens",
                         str(BLOCK_TOKENS), "--trace-time-scale", str(time_scale), "--disable-tqdm"])
    r = serve.benchmark(proxy, args)
    return {"completed": r["completed"], "failed": r["failed"], "duration_s": round(r["duration"], 2)}


class Checker:
    """Checkpoints: the proxy's index beside the instances' caches, and the followers' repairs
    since the previous checkpoint (a restarted instance's follower counts from zero)."""

    def __init__(self, dep: Deployment):
        self.dep = dep
        self.last: dict[str, dict] = {}
        self.checkpoints: list[dict] = []

    def cached(self) -> set[tuple[str, int]]:
        return {(i.url, h) for i in self.dep.instances for h in get(i.url + "/debug/kv_cached_hashes")["block_hashes"]}

    def indexed(self) -> tuple[set[tuple[str, int]], dict]:
        got = get(self.dep.proxy.url + "/kv/index?hashes=true")
        return {(url, h) for url, hashes in got["instances"].items() for h in hashes}, got["repairs"]

    def wait_idle(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        for inst in self.dep.instances:
            while True:
                s = get(inst.url + "/debug/stats")
                if not s["num_running"] and not s["num_waiting"]:
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{inst.url} still busy after {timeout_s} s: {s}")
                time.sleep(0.05)

    def forget(self, url: str) -> None:
        """The instance restarted: its next follower's counts start from zero."""
        self.last.pop(url, None)

    def checkpoint(self, name: str, **extra) -> dict:
        self.wait_idle()
        quiet = time.monotonic()
        while True:
            cached = self.cached()
            index, repairs = self.indexed()
            waited_s = time.monotonic() - quiet
            if index == cached or waited_s > EXACT_WITHIN_S:
                break
            time.sleep(0.02)
        since = {k: 0 for k in REPAIRS}
        for url, counts in repairs.items():
            before = self.last.get(url, dict.fromkeys(REPAIRS, 0))
            for k in REPAIRS:
                since[k] += counts[k] - before[k]
        self.last = repairs
        c = {"checkpoint": name, "exact": index == cached, "time_to_exact_ms": round(waited_s * 1e3, 1)
             if index == cached else None, "cached_blocks": len(cached), "indexed_blocks": len(index),
             "missing_from_index": len(cached - index), "extra_in_index": len(index - cached),
             "blocks_by_instance": {i.url: sum(1 for u, _ in cached if u == i.url) for i in self.dep.instances},
             **since, **extra}
        self.checkpoints.append(c)
        print(f"  {name}: exact {c['exact']}, {c['cached_blocks']} blocks, {c['batches_dropped']} of "
              f"{c['batches_received']} batches dropped, {c['snapshots']} snapshot(s)", flush=True)
        return c


def restart(dep: Deployment, inst: Instance, checker: Checker) -> float:
    """SIGKILL, until the proxy has dropped its index, then again at its port until the proxy follows
    it anew; seconds from the kill until the proxy indexes the new process."""
    killed = time.monotonic()
    inst.kill()
    wait_for(lambda: inst.url not in get(dep.proxy.url + "/kv/index")["instances"], 30, "the proxy to drop it")
    inst.args += ["--port", str(inst.port)]  # the last --port wins: the proxy knows this URL
    inst.spawn(dep.log_dir, dep.env).wait_healthy(120)
    checker.forget(inst.url)
    wait_for(lambda: inst.url in get(dep.proxy.url + "/kv/index")["instances"], 30, "the proxy to follow it")
    return time.monotonic() - killed


def wait_for(done, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout_s} s for {what}")
        time.sleep(0.05)


def reset(inst: Instance) -> int:
    return post(inst.url + "/reset_prefix_cache")["num_blocks_cleared"]


def run(dep: Deployment, args, work: Path) -> Checker:
    checker = Checker(dep)
    (p0, p1), (d0, d1) = dep.prefill, dep.decode

    def phase(n: int, reset_during: Instance | None = None) -> None:
        cleared = []
        side = threading.Timer(args.reset_after_s, lambda: cleared.append(reset(reset_during)))
        if reset_during:
            side.start()
        load = replay(dep.proxy.url, conversation_trace(args.rows, args.seed + n), work, f"phase{n}", args.time_scale)
        if reset_during:
            side.join()
            load["blocks_cleared_mid_phase"] = cleared[0] if cleared else None
        checker.checkpoint(f"phase {n}", **load)

    print("phase 1", flush=True)
    phase(1)
    took = restart(dep, d1, checker)
    checker.checkpoint("decode 1 restarted", restart_s=round(took, 2))
    print("phase 2", flush=True)
    phase(2)
    checker.checkpoint("producer 0 reset", blocks_cleared=reset(p0))
    print("phase 3 (decode 0 reset mid-phase)", flush=True)
    phase(3, reset_during=d0)
    took = restart(dep, p1, checker)
    checker.checkpoint("producer 1 restarted", restart_s=round(took, 2))
    print("phase 4", flush=True)
    phase(4)
    return checker


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=48, help="trace rows per phase")
    ap.add_argument("--num-blocks", type=int, default=64, help="KV blocks per instance")
    ap.add_argument("--drop", type=float, default=0.01, help="the share of KV event batches the proxy loses")
    ap.add_argument("--time-scale", type=float, default=0.3, help="--trace-time-scale of every phase")
    ap.add_argument("--reset-after-s", type=float, default=3.0, help="into phase 3, decode 0's cache is reset")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "index_exactness.json"))
    args = ap.parse_args()
    serve.quiet()
    model = ensure_model(None, "tiny")
    work = Path(tempfile.mkdtemp(prefix="pdserve-index-exactness-"))
    dep = Deployment(model, [1, 1], [1, 1], log_dir=str(work),
                     instance_args=["--mock-engine", "--num-blocks", str(args.num_blocks), "--max-num-seqs", "16",
                                    "--enable-debug-endpoints"],
                     proxy_args=["--kv-events-drop-fraction", str(args.drop), "--kv-events-drop-seed", str(args.seed)])
    busy = busy_cores()
    started = time.monotonic()
    try:
        dep.start(timeout_s=120)
        checker = run(dep, args, work)
    finally:
        dep.stop()
    points = checker.checkpoints
    out = {"instances": "2P2D --mock-engine tiny", "num_blocks_per_instance": args.num_blocks,
           "drop_fraction": args.drop, "seed": args.seed, "rows_per_phase": args.rows,
           "trace_block_tokens": BLOCK_TOKENS, "exact_within_s": EXACT_WITHIN_S,
           "background_busy_cores": None if busy is None else round(busy, 2),
           "all_exact": all(c["exact"] for c in points), "checkpoints": points,
           "batches_dropped": sum(c["batches_dropped"] for c in points),
           "batches_received": sum(c["batches_received"] for c in points),
           "snapshots": sum(c["snapshots"] for c in points), "runtime_s": round(time.monotonic() - started, 1)}
    print(f"\n{'checkpoint':22} | exact | to exact ms | blocks | received | dropped | gaps | replayed | snapshots")
    for c in points:
        ms = "-" if c["time_to_exact_ms"] is None else c["time_to_exact_ms"]
        print(f"{c['checkpoint']:22} | {str(c['exact']):5} | {ms:>11} | {c['cached_blocks']:6} | "
              f"{c['batches_received']:8} | {c['batches_dropped']:7} | {c['gaps']:4} | {c['batches_replayed']:8} | "
              f"{c['snapshots']:9}")
    print(f"all exact: {out['all_exact']} ({out['batches_dropped']} of {out['batches_received']} batches dropped, "
          f"{out['snapshots']} snapshot(s)); {out['runtime_s']} s")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    return 0 if out["all_exact"] else 1


if __name__ == "__main__":
    sys.exit(main())
