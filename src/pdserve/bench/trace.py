"""Mooncake-format traces for `pdserve bench serve --dataset-name trace`: JSONL rows of `timestamp`
(ms), `input_length`, `output_length`, `hash_ids` and an optional `session_id`.

Any process (pure functions). Each hash id stands for one block of the trace's own size (512 tokens
in Mooncake's) and becomes `block_tokens` token ids derived from the id alone, so equal ids give
equal tokens (a prefix a cache can reuse) in every run and every process. Lengths scale by
`block_tokens` / the trace's block size, so a smaller block shrinks the whole trace and keeps its
reuse. A malformed row is skipped and counted, never fatal.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import random
from pathlib import Path

MOONCAKE_BLOCK_TOKENS = 512


@dataclasses.dataclass(frozen=True)
class TraceRow:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    session_id: str | None = None


@dataclasses.dataclass(frozen=True)
class BlockPrompt:
    """A prompt made of hash-id blocks, built when sent (a trace's prompts need not all fit in memory):
    the blocks' tokens cut to `length`, then tokens of this prompt's own (`fill_key`) if the blocks
    are too few."""

    hash_ids: tuple[int, ...]
    length: int
    block_tokens: int
    fill_key: str
    vocab_lo: int
    vocab_hi: int

    def ids(self) -> list[int]:
        out: list[int] = []
        for h in self.hash_ids:
            if len(out) >= self.length:
                break
            out.extend(block_ids(h, self.block_tokens, self.vocab_lo, self.vocab_hi))
        del out[self.length:]
        if len(out) < self.length:
            rng = random.Random(self.fill_key)
            out.extend(rng.choices(range(self.vocab_lo, self.vocab_hi), k=self.length - len(out)))
        return out


@functools.lru_cache(maxsize=4096)
def block_ids(hash_id: int, block_tokens: int, vocab_lo: int, vocab_hi: int) -> tuple[int, ...]:
    """The token ids of one hash id's block: a function of the id (and the block's shape) only."""
    return tuple(random.Random(f"block:{hash_id}").choices(range(vocab_lo, vocab_hi), k=block_tokens))


def read_trace(path: str | Path) -> tuple[list[TraceRow], int]:
    """(the well-formed rows in timestamp order, the number of malformed rows skipped). Blank
    lines are neither; a missing or unreadable file raises ValueError naming it."""
    try:
        text = Path(path).read_bytes().decode("utf-8", errors="replace")
    except OSError as e:
        raise ValueError(f"--dataset-path {path}: {e.strerror or e}") from None
    rows, skipped = [], 0
    for line in text.splitlines():
        if not line.strip():
            continue
        row = parse_row(line)
        if row is None:
            skipped += 1
        else:
            rows.append(row)
    rows.sort(key=lambda r: r.timestamp_ms)  # stable: equal timestamps keep the file's order
    return rows, skipped


def parse_row(line: str) -> TraceRow | None:
    """One JSONL row, or None if it is not a row of this format."""
    try:
        item = json.loads(line)
    except (ValueError, RecursionError):
        return None
    if not isinstance(item, dict):
        return None
    ts, n_in, n_out, ids = (item.get(k) for k in ("timestamp", "input_length", "output_length", "hash_ids"))
    session = item.get("session_id")
    if not _number(ts) or not math.isfinite(ts) or not _int(n_in) or not _int(n_out) or n_in < 1 or n_out < 1:
        return None
    if not isinstance(ids, list) or not all(_int(h) for h in ids):
        return None
    if session is not None and (isinstance(session, bool) or not isinstance(session, (str, int))):
        return None
    return TraceRow(float(ts), n_in, n_out, tuple(ids), None if session is None else str(session))


def _int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def scaled_length(input_length: int, block_tokens: int, source_block_tokens: int) -> int:
    return max(1, math.ceil(input_length * block_tokens / source_block_tokens))


def conversation_trace(rows: int, seed: int) -> list[dict]:
    """A trace of `rows` rows (as JSON objects, seeded): conversations over four shared system
    prompts of 2-4 hash ids, each turn the history + 1-3 new hash ids, the answer's id joining the
    history; new conversations start at ~4 per second of trace time, 0.5-3 s of think time
    between turns, at most 8 turns or 15 hash ids each."""
    rng = random.Random(seed)
    systems = [[1000 * s + i for i in range(rng.randint(2, 4))] for s in range(4)]
    next_id, out, t = 10**6, [], 0.0
    sessions = []
    while len(out) < rows:
        if not sessions or rng.random() < 0.35:  # a new conversation starts
            sessions.append({"id": len(sessions), "ids": list(rng.choice(systems)), "turns": 0, "at": t})
        s = rng.choice(sessions)
        new = list(range(next_id, next_id + rng.randint(1, 3)))
        next_id += len(new)
        s["ids"] += new
        s["turns"] += 1
        s["at"] = max(s["at"], t) + rng.uniform(0.5, 3.0)  # think time
        out.append({"timestamp": round(s["at"] * 1000), "input_length": len(s["ids"]) * 512,
                    "output_length": rng.randint(2, 8) * 8, "hash_ids": list(s["ids"]),
                    "session_id": s["id"]})
        s["ids"] += [next_id]  # the answer joins the history
        next_id += 1
        if s["turns"] >= 8 or len(s["ids"]) > 14:
            sessions.remove(s)
        t += rng.expovariate(4.0)
    out.sort(key=lambda r: r["timestamp"])
    return out
