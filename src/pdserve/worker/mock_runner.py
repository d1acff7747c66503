"""A model that computes nothing, for routing at scale: many instances on two cores.

Runs in every TP rank of an instance started with `--mock-engine`, in place of ModelRunner. A step
takes the time this machine's real engine would (`TimingModel`, calibrated from bench/engine.py and
scaled by `--mock-speedup`), spent sleeping rather than on a core. Each token's id is written into
its KV slots (every layer, K and V, every head this rank holds), and the next token is a fixed
function of the context as read back from the cache, so P/D transfers, pulls and delta reads move
real bytes over real NIXL, and an answer comes out right only if the KV it read was.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import torch

from pdserve.worker.kv_cache import KVCache
from pdserve.worker.messages import ScheduledChunk

MARGIN = 30.0  # the chosen token's logit over every other's: sampling at any temperature picks it
FIRST_TOKEN = 7  # past the special tokens of the generated models


@dataclasses.dataclass(frozen=True)
class TimingModel:
    """Seconds of one step on one core of this machine for the `small` model (bench/engine.py,
    float32, one thread): a fixed part, each prompt token, each decoded row, each context token a
    decoded row attends to."""

    step_s: float = 0.004
    prefill_token_s: float = 0.0008
    decode_row_s: float = 0.0015
    context_token_s: float = 1e-6

    def step_time(self, prefill_tokens: int, decode_rows: int, context_tokens: int) -> float:
        return (self.step_s + self.prefill_token_s * prefill_tokens + self.decode_row_s * decode_rows
                + self.context_token_s * context_tokens)


_WEIGHTS = np.random.default_rng(0).integers(1, 1 << 20, size=1 << 17, dtype=np.int64)  # per position


def next_token(context, vocab_size: int) -> int:
    """The mock's greedy choice after `context` (token ids): a fixed function of every token and
    its position, so a context that differs anywhere (wrong KV read) gives another answer."""
    tokens = np.asarray(context, dtype=np.int64)
    h = int(np.dot(tokens, _WEIGHTS[:len(tokens)]) % 2_147_483_647) + 31 * len(tokens)
    return FIRST_TOKEN + h % (vocab_size - FIRST_TOKEN)


class MockRunner:
    def __init__(self, kv_cache: KVCache, vocab_size: int, timing: TimingModel = TimingModel(),
                 speedup: float = 1.0, sleep=time.sleep):
        self.kv_cache = kv_cache
        self.block_size = kv_cache.layout.block_size
        self.vocab_size = vocab_size
        self.timing = timing
        self.speedup = speedup
        self._sleep = sleep

    def execute(self, chunks: list[ScheduledChunk]) -> tuple[torch.Tensor | None, list[str], list]:
        """Write the chunks' tokens into the cache, wait as long as the real step would, and
        return one-hot logits [sampled rows, vocab] for the chunks that sample."""
        prefill = sum(len(c.token_ids) for c in chunks if len(c.token_ids) > 1)
        decodes = [c for c in chunks if len(c.token_ids) == 1]
        context = sum(c.start_pos + 1 for c in decodes)
        started = time.monotonic()
        for c in chunks:
            self._write(c)
        rows, ids = [], []
        for c in chunks:
            if c.sample:
                rows.append(next_token(self._context(c), self.vocab_size))
                ids.append(c.request_id)
        spent = time.monotonic() - started
        self._sleep(max(0.0, self.timing.step_time(prefill, len(decodes), context) / self.speedup - spent))
        if not rows:
            return None, [], []
        logits = torch.zeros(len(rows), self.vocab_size)
        logits[torch.arange(len(rows)), torch.tensor(rows)] = MARGIN
        return logits, ids, []  # prompt tokens are not scored

    def _slots(self, block_ids: list[int], start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.arange(start, end)
        blocks = torch.tensor(block_ids, dtype=torch.long)[positions // self.block_size]
        return blocks, positions % self.block_size

    def _write(self, c: ScheduledChunk) -> None:
        blocks, slots = self._slots(c.block_ids, c.start_pos, c.start_pos + len(c.token_ids))
        values = torch.tensor(c.token_ids, dtype=self.kv_cache.buffer.dtype)
        # buffer [layers, K/V, blocks, heads, block_size, head_dim]: every element of a token's slot
        self.kv_cache.buffer[:, :, blocks, :, slots, :] = values[:, None, None, None, None]  # (indexed dim first)

    def _context(self, c: ScheduledChunk) -> np.ndarray:
        """The tokens the cache holds for positions 0 .. the chunk's last (layer 0, K, first head)."""
        blocks, slots = self._slots(c.block_ids, 0, c.start_pos + len(c.token_ids))
        return self.kv_cache.buffer[0, 0, blocks, 0, slots, 0].numpy().astype(np.int64)
