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
