"""What a weight format does to a model's answers: perplexity on a fixed text, and how often its
most likely next token is float32's.

Benchmark process (bench/quality.py) and tests: one TP-1 model in this process, no engine. The text
is scored in independent windows, each one prefill from position 0.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from pdserve.model import kv_dtype
from pdserve.model.loader import load_model
from pdserve.model.parallel import TPGroup
from pdserve.model.spec import ModelSpec, resolve_dtype
from pdserve.worker.kv_cache import CacheLayout, KVCache
from pdserve.worker.messages import ScheduledChunk
from pdserve.worker.model_runner import ModelRunner


@dataclasses.dataclass(frozen=True)
class Score:
    perplexity: float
    num_tokens: int  # tokens predicted
    top1: torch.Tensor  # [num_tokens] the most likely next token at each position


class Scorer:
    """A model (checkpoint directory, dtype, quantization) that scores token sequences."""

    def __init__(self, model_dir: str, dtype: str = "float32", quantization: str | None = None,
                 window: int = 512, kv_cache_dtype: str = "auto", chunk_tokens: int | None = None):
        """`chunk_tokens`: prefill each window in chunks of this many tokens, each reading the
        earlier ones from the cache as stored (so the KV cache dtype counts); None: one prefill."""
        spec = ModelSpec.from_dir(model_dir)
        torch_dtype = resolve_dtype(dtype, spec)
        self.window, self.chunk_tokens = window, chunk_tokens
        self.model = load_model(model_dir, spec, TPGroup(0, 1), torch_dtype, quantization)
        block_size = 16
        kv_name = kv_dtype.resolve(kv_cache_dtype, torch_dtype)
        layout = CacheLayout.for_dtype(spec.num_layers, -(-(window + 1) // block_size),
                                       self.model.layers[0].num_kv_heads, block_size, spec.head_dim, kv_name)
        self.runner = ModelRunner(self.model, KVCache(layout, kv_dtype.torch_dtype(kv_name)))

    def score(self, token_ids: list[int]) -> Score:
        nll, count, top1 = 0.0, 0, []
        for start in range(0, len(token_ids) - 1, self.window):
            chunk = token_ids[start:start + self.window + 1]
            if len(chunk) < 2:
                break
            logprobs, best = self._score(chunk)
            nll -= float(logprobs.double().sum())
            count += len(chunk) - 1
            top1.append(best)
        return Score(math.exp(nll / count), count, torch.cat(top1))

    @torch.inference_mode()
    def _score(self, token_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        if self.chunk_tokens is None:
            return self.runner.score(token_ids)
        blocks, step = list(range(-(-len(token_ids) // 16))), self.chunk_tokens
        hidden = torch.cat([self.runner._forward([ScheduledChunk("score", token_ids[i:i + step], i, blocks, False)])[0]
                            for i in range(0, len(token_ids), step)])
        logprobs = torch.log_softmax(self.model.compute_logits(hidden[:-1]), dim=-1)
        nxt = torch.tensor(token_ids[1:], dtype=torch.long)
        return logprobs.gather(1, nxt[:, None])[:, 0], logprobs.argmax(dim=-1)


def agreement(a: Score, b: Score) -> float:
    """The fraction of positions whose most likely next token is the same under both."""
    return float((a.top1 == b.top1).double().mean())
