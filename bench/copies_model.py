"""An offline model of which copy of a disaggregated prompt's KV to keep (proxy/copies.py), on
bench/routing.py's conversation trace: 4 producers and 4 decode instances, each an LRU cache of
`--num-blocks` 16-token blocks with a spare list evicted first, no timing.

    .venv/bin/python bench/copies_model.py [--rows 800] [--num-blocks 384]

A request hits the longest prefix any instance caches (producers claim from every instance).
Decode goes where the prompt's history is, else takes turns; producers take turns (a pull makes
them alike). The producer caches the prompt, decode the prompt and its answer (whose tokens the
next turn does not repeat in this trace). Rules, each printed with its hit rate and the one LRU
cache of all the blocks beside them:

  both        both copies kept (--kv-copies both)
  keep-P      the decode copy always spare; keep-D the producer's
  per-request the kept copy alternates request by request
  one         alternates by conversation, a turn keeps its history's pool
  one+move    pdserve's: and an instance that lends a history to a producer that keeps it makes
              its copy of what it lent spare (a lent shared system prompt is kept again when a
              request of its own uses it)

With `--placements LOG --result RUN.json --trace TRACE.jsonl` it replays a real run instead: the
proxy's `--placement-log` of a `pdserve bench serve` run on that trace (bench/routing.py keeps its
trace and results in its work directory; pass `--proxy-args "--placement-log LOG"` to `pdserve up`),
each request placed where the proxy placed it (a holder that does not keep the prompt demoting
what it lends), and prints the model's hit rate beside the run's.
A real run well below its own placements' replay loses cache content the model keeps (so found: a
producer's kept copy demoted by a later spare copy, 0.595 against 0.640).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from collections import OrderedDict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from pdserve.bench.trace import conversation_trace  # noqa: E402

BLOCKS_PER_ID = 4  # bench/routing.py: 64 tokens per hash id, 16 per block
PULL_MIN_BLOCKS = 4  # an instance pulls 64 tokens at least (--kv-pull-min-tokens)


class Cache:
    def __init__(self, capacity: int):
        self.capacity = capacity
        self.kept: OrderedDict[int, None] = OrderedDict()
        self.spare: OrderedDict[int, None] = OrderedDict()  # evicted first

    def prefix(self, blocks: list[int]) -> int:
        return next((i for i, b in enumerate(blocks) if b not in self.kept and b not in self.spare), len(blocks))

    def put(self, blocks: list[int], spare: bool) -> None:
        for b in reversed(blocks):  # tail first: the head is evicted last
            if spare and b in self.kept:  # kept wins while cached
                self.kept.move_to_end(b)
                continue
            self.kept.pop(b, None)
            self.spare.pop(b, None)
            (self.spare if spare else self.kept)[b] = None
        while len(self.kept) + len(self.spare) > self.capacity:
            (self.spare or self.kept).popitem(last=False)

    def demote(self, blocks: list[int]) -> None:
        for b in blocks:
            if self.kept.pop(b, 0) is None:
                self.spare[b] = None


def chain(hash_ids: list[int]) -> list[int]:
    out, parent = [], 0
    for h in hash_ids:
        for i in range(BLOCKS_PER_ID):
            parent = hash((parent, h, i))
            out.append(parent)
    return out


def replay(rows: list[dict], capacity: int, rule: str) -> float:
    producers, decodes = [Cache(capacity) for _ in range(4)], [Cache(capacity) for _ in range(4)]
    answers = itertools.count(1 << 62)
    keeper: dict[int, bool] = {}  # a prompt's last block -> whether the producer keeps it
    hit = total = turn = conversations = 0
    for row in rows:
        blocks = chain(row["hash_ids"])
        total += len(blocks)
        hit += max(c.prefix(blocks) for c in producers + decodes)
        d = max(decodes, key=lambda c: c.prefix(blocks))
        d = d if d.prefix(blocks) else decodes[turn % 4]
        p = producers[turn % 4]
        turn += 1
        if rule in ("one", "one+move"):
            keep_p = next((keeper[b] for b in reversed(blocks) if b in keeper), None)
            if keep_p is None:
                conversations += 1
                keep_p = conversations % 2 == 0
            keeper[blocks[-1]] = keep_p
        else:
            keep_p = {"both": None, "keep-P": True, "keep-D": False, "per-request": turn % 2 == 0}[rule]
        if rule == "one+move" and keep_p:
            lend(p, [c for c in producers + decodes if c is not p], blocks)
        answer = [next(answers) for _ in range(row["output_length"] // 16)]
        p.put(blocks, spare=keep_p is False)
        d.put(blocks + answer, spare=keep_p is True)
    return hit / total


def lend(claimer: Cache, others: list[Cache], blocks: list[int], keeper: Cache | None = None) -> None:
    """`claimer` pulls the prompt's blocks it lacks from the instance caching most of them (when
    that is at least PULL_MIN_BLOCKS more); the lender's copy of what it lent becomes a spare,
    unless the lender is the instance keeping the prompt."""
    if not others:
        return
    lender = max(others, key=lambda c: c.prefix(blocks))
    have, held = claimer.prefix(blocks), lender.prefix(blocks)
    if held - have >= PULL_MIN_BLOCKS and lender is not keeper:
        lender.demote(blocks[have:held])


def replay_placements(rows: list[dict], placements: list[dict], starts: list[float], capacity: int) -> float:
    """The hit rate of `rows` placed as logged (log lines in arrival order, rows in the order their
    requests started), each instance an LRU cache of `capacity` blocks."""
    order = sorted(range(len(rows)), key=lambda i: starts[i])
    if len(order) != len(placements):
        raise SystemExit(f"{len(placements)} placements for {len(order)} requests")
    caches: dict[str, Cache] = {}
    answers = itertools.count(1 << 62)
    hit = total = 0
    for i, p in zip(order, placements):
        blocks = chain(rows[i]["hash_ids"])
        total += len(blocks)
        hit += max((c.prefix(blocks) for c in caches.values()), default=0)
        answer = [next(answers) for _ in range(rows[i]["output_length"] // 16)]
        computer = caches.setdefault(p["prefill"] or p["decode"], Cache(capacity))
        if p["decision"] == "local" or p["spare_copy"] is not None:  # one copy kept: a moved history's lender
            kept_on = p["decode"] if p["decision"] == "local" or p["spare_copy"] == "prefill" else p["prefill"]
            lend(computer, [c for c in caches.values() if c is not computer], blocks,
                 caches.setdefault(kept_on, Cache(capacity)))
        if p["prefill"] is not None:
            caches.setdefault(p["prefill"], Cache(capacity)).put(blocks, spare=p["spare_copy"] == "prefill")
        caches.setdefault(p["decode"], Cache(capacity)).put(blocks + answer, spare=p["spare_copy"] == "decode")
    return hit / total


def lru(rows: list[dict], capacity: int) -> float:
    cache, hit, total = Cache(capacity), 0, 0
    for row in rows:
        blocks = chain(row["hash_ids"])
        total += len(blocks)
        hit += cache.prefix(blocks)
        cache.put(blocks, spare=False)
    return hit / total


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=800)
    p.add_argument("--num-blocks", type=int, default=384, help="blocks per instance")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--placements", default=None, help="a proxy's --placement-log of a run (with --result, --trace)")
    p.add_argument("--result", default=None, help="that run's `pdserve bench serve --save-result` file")
    p.add_argument("--trace", default=None, help="the trace it replayed")
    args = p.parse_args()
    if args.placements:
        run = json.loads(Path(args.result).read_text())
        rows = [json.loads(line) for line in Path(args.trace).read_text().splitlines() if line.strip()]
        placements = [json.loads(line) for line in Path(args.placements).read_text().splitlines() if line.strip()]
        rate = replay_placements(rows, placements, run["starts"], args.num_blocks)
        print(f"the run's placements replayed: hit rate {rate:.3f}; the run itself: {run['prefill_hit_rate']:.3f}")
        return
    rows = conversation_trace(args.rows, args.seed)
    bound = lru(rows, 8 * args.num_blocks)
    print(f"one LRU cache of {8 * args.num_blocks} blocks: {bound:.3f}; of {4 * args.num_blocks}: "
          f"{lru(rows, 4 * args.num_blocks):.3f}")
    for rule in ("both", "keep-P", "keep-D", "per-request", "one", "one+move"):
        rate = replay(rows, args.num_blocks, rule)
        print(f"{rule:12} hit rate {rate:.3f} ({rate / bound:.3f} of the bound)")


if __name__ == "__main__":
    main()
