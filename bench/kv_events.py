"""KV events after loss: how long a subscriber that loses 1 % of an instance's batches takes to hold
exactly the instance's cached blocks again once the run goes quiet (issue 20's target: 1 s).

    .venv/bin/python bench/kv_events.py [--requests 500] [--drop 0.01] [--num-blocks 48]

One `pdserve serve` (the generated `tiny` model, core 0, one thread) with --kv-events-config (ZMQ
PUB and replay on port 0, replay buffer of 64 batches) and a KV budget that a few prompts fill, so
blocks are evicted all along. Requests are sent one at a time; batches are dropped in the
subscriber before it applies them (seeded). Two followers (prefix_cache/subscriber.py):
"live" reads while the run goes on and repairs gaps by replay; "behind" reads nothing until the run
ends, when its first losses have left the replay buffer, so it needs a snapshot. Beside each, a
subscriber that applies whatever arrives and never repairs: how wrong loss leaves it.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from pdserve.bench.machine import busy_cores  # noqa: E402
from pdserve.cli import ensure_model  # noqa: E402
from pdserve.launcher import Instance  # noqa: E402
from pdserve.prefix_cache.events import BlockRemoved, BlockStored  # noqa: E402
from pdserve.prefix_cache.subscriber import (KVEventFollower, KVEventSubscriber,  # noqa: E402
                                             http_snapshot)

BUFFER_STEPS = 64
TARGET_S = 1.0


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def prompts(n: int, seed: int) -> list[list[int]]:
    """Half share one of four 48-token prefixes; 3 to 6 blocks each."""
    rng = random.Random(seed)
    shared = [[rng.randrange(7, 1000) for _ in range(48)] for _ in range(4)]
    return [(shared[i % 4] if i % 2 else []) + [rng.randrange(7, 1000) for _ in range(rng.randrange(40, 64))]
            for i in range(n)]


def send(url: str, batch: list[list[int]]) -> None:
    for p in batch:
        post(url + "/v1/completions", {"prompt": p, "max_tokens": 6, "temperature": 0, "ignore_eos": True})


class Naive:
    """Applies every batch that arrives, in arrival order, and never repairs a gap."""

    def __init__(self, sub: KVEventSubscriber):
        self.sub = sub
        self.hashes: set[int] = set()

    def drain(self, timeout_s: float = 0.0) -> None:
        while (got := self.sub.recv(timeout_s)) is not None:
            for e in got[2].events:
                if isinstance(e, BlockStored):
                    self.hashes.update(e.block_hashes)
                elif isinstance(e, BlockRemoved):
                    self.hashes.difference_update(e.block_hashes)
                else:
                    self.hashes.clear()


def run(url: str, info: dict, scenario: str, batch: list[list[int]], drop: float, seed: int) -> dict:
    events = info["kv_events"]

    def subscriber():
        return KVEventSubscriber(events["endpoint"], events["replay_endpoint"], topic=events["topic"],
                                 drop_fraction=drop, seed=seed)
    snapshot = http_snapshot(url)
    follower, naive = KVEventFollower(subscriber(), snapshot), Naive(subscriber())
    follower.index.load(snapshot())
    naive.hashes = set(follower.index.hashes)
    time.sleep(0.2)  # both SUB sockets connected before the run (else they lose its first batches)
    try:
        sender = threading.Thread(target=send, args=(url, batch))
        sender.start()
        while sender.is_alive():
            if scenario == "live":
                follower.poll()
                naive.drain()
            else:
                sender.join(0.1)
        sender.join()
        quiet = time.monotonic()
        held = set(get(url + "/debug/kv_cached_hashes")["block_hashes"])
        exact = follower.follow_until(lambda index: index.hashes == held, timeout_s=10.0)
        took_s = time.monotonic() - quiet
        follower.follow_until(lambda _: False, timeout_s=0.3)  # the rest still queued changes nothing
        still_exact = follower.index.hashes == held
        naive.drain(0.3)
    finally:
        follower.subscriber.close()
        naive.sub.close()
    sub = follower.subscriber
    return {"scenario": scenario, "requests": len(batch), "batches_received": sub.num_received,
            "batches_dropped": sub.num_dropped, "gaps": follower.num_gaps,
            "batches_replayed": follower.num_replayed, "snapshots": follower.num_snapshots,
            "cached_blocks": len(held), "exact": exact and still_exact,
            "time_to_exact_ms": round(took_s * 1e3, 1),
            "unrepaired_wrong_hashes": len(naive.hashes ^ held)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=500)
    ap.add_argument("--drop", type=float, default=0.01)
    ap.add_argument("--num-blocks", type=int, default=48)
    ap.add_argument("--seed", type=int, default=6)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "kv_events.json"))
    args = ap.parse_args()
    model = ensure_model(None, "tiny")
    config = {"enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:0",
              "replay_endpoint": "tcp://127.0.0.1:0", "buffer_steps": BUFFER_STEPS}
    inst = Instance("kv-events", ["serve", model, "--port", "0", "--num-threads", "1", "--cpus", "0",
                                  "--num-blocks", str(args.num_blocks), "--no-kv-transfer",
                                  "--enable-debug-endpoints", "--kv-events-config", json.dumps(config)],
                    cpus=(0,))
    busy = busy_cores()
    results = {"drop_fraction": args.drop, "seed": args.seed, "num_blocks": args.num_blocks,
               "replay_buffer_batches": BUFFER_STEPS, "target_s": TARGET_S,
               "background_busy_cores": None if busy is None else round(busy, 2), "runs": []}
    try:
        inst.spawn(Path(tempfile.mkdtemp(prefix="pdserve-bench-"))).wait_healthy()
        info = get(inst.url + "/health")["prefix_cache"]
        send(inst.url, prompts(4, 99))  # warm-up
        for i, scenario in enumerate(("live", "behind")):
            r = run(inst.url, info, scenario, prompts(args.requests, i), args.drop, args.seed + i)
            results["runs"].append(r)
    finally:
        inst.stop()
    print("scenario | requests | batches | dropped | gaps | replayed | snapshots | exact | to exact ms "
          "| unrepaired wrong hashes")
    for r in results["runs"]:
        print(f"{r['scenario']:8} | {r['requests']:8} | {r['batches_received']:7} | {r['batches_dropped']:7} | "
              f"{r['gaps']:4} | {r['batches_replayed']:8} | {r['snapshots']:9} | {str(r['exact']):5} | "
              f"{r['time_to_exact_ms']:11} | {r['unrepaired_wrong_hashes']}")
    print(f"target: exact within {TARGET_S * 1e3:.0f} ms of the run going quiet")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
