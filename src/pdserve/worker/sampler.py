"""Token sampling on TP rank 0: greedy, temperature, top-k, top-p, per-request seeds, logprobs.

Runs in rank 0 only, once per step. Sampling draws one exponential vector per sampled token
(`argmax(p / q)`, q ~ Exp(1)), so a seeded request consumes its generator identically whether it runs
alone, batched, after preemption, or continues from a P/D producer's first token (`num_presampled`).
Logprobs are those of the raw model output, before temperature and truncation, as vLLM reports them.
Per-request logits controls (logit_bias, penalties, ...: logits_controls.py) adjust a copy of their
own rows (`adjusted`); a batch whose requests have none pays nothing for them.
"""

from __future__ import annotations

import torch

from pdserve.model.fused import argmax_logsumexp
from pdserve.sampling_params import StructuredOutputs
from pdserve.structured.matchers import Matchers
from pdserve.worker.logits_controls import RequestControls, apply_controls, take_rows
from pdserve.worker.messages import PromptLogprobs, SampledToken, SamplingSpec, ScheduledChunk

_GREEDY_EPS = 1e-5


class Sampler:
    def __init__(self, vocab_size: int, grammars: Matchers | None = None):
        self.vocab_size = vocab_size
        self.grammars = grammars  # structured outputs; None: this sampler refuses none, masks none
        self.specs: dict[str, SamplingSpec] = {}
        self.generators: dict[str, torch.Generator] = {}
        self.controls: dict[str, RequestControls] = {}
        self.shared = torch.Generator()
        self.shared.seed()

    def add(self, request_id: str, spec: SamplingSpec) -> None:
        self.specs[request_id] = spec
        if spec.seed is not None and spec.temperature >= _GREEDY_EPS:
            g = torch.Generator().manual_seed(spec.seed)
            for _ in range(spec.num_presampled):
                self._noise(g)
            self.generators[request_id] = g
        if spec.controls is not None:
            self.controls[request_id] = RequestControls(spec.controls, self.vocab_size)
        if spec.grammar is not None and self.grammars is not None:
            g = spec.grammar
            self.grammars.add(request_id, StructuredOutputs(g.kind, g.value), g.prefix_ids)

    def remove(self, request_id: str) -> None:
        self.specs.pop(request_id, None)
        self.generators.pop(request_id, None)
        self.controls.pop(request_id, None)
        if self.grammars is not None:
            self.grammars.remove(request_id)

    def adjusted(self, logits: torch.Tensor, request_ids: list[str]) -> tuple[list[int], torch.Tensor | None]:
        """The rows whose requests adjust their logits before sampling, and those rows adjusted
        ([len(rows), vocab], a copy: logprobs stay the raw model's). ([], None) when none does."""
        rows = [i for i, rid in enumerate(request_ids) if rid in self.controls]
        if not rows:
            return rows, None
        x = take_rows(logits, rows)
        apply_controls(x, [self.controls[request_ids[i]] for i in rows])
        return rows, x

    def sample(self, logits: torch.Tensor, request_ids: list[str]) -> list[SampledToken]:
        """logits: [rows, vocab] float32, one row per request id."""
        if self.grammars:  # structured outputs: tokens a row's grammar forbids -> -inf, in place
            self.grammars.mask(logits, request_ids)
        greedy, lse = argmax_logsumexp(logits)  # log_softmax(x) = x - logsumexp(x)
        tokens = greedy.tolist()
        rows, adjusted = self.adjusted(logits, request_ids)
        if adjusted is not None:
            for i, token in zip(rows, argmax_logsumexp(adjusted)[0].tolist()):
                tokens[i] = token
        row_of = {i: j for j, i in enumerate(rows)}
        for i, rid in enumerate(request_ids):
            spec = self.specs[rid]
            if spec.temperature >= _GREEDY_EPS:
                row = adjusted[row_of[i]] if i in row_of else logits[i]
                tokens[i] = self._sample_row(row, spec, self.generators.get(rid, self.shared))
        for i in rows:
            self.controls[request_ids[i]].append(tokens[i])
        if self.grammars:
            self.grammars.accept(request_ids, tokens)
        token_lp = (logits.gather(1, torch.tensor(tokens)[:, None])[:, 0] - lse).tolist()
        max_n = max((self.specs[r].num_logprobs or 0) for r in request_ids)
        top = None
        if max_n:
            values, indices = logits.topk(max_n, dim=-1)
            top = (indices.tolist(), (values - lse[:, None]).tolist())
        out = []
        for i, rid in enumerate(request_ids):
            n = self.specs[rid].num_logprobs
            tops = None
            if n is not None:
                tops = list(zip(top[0][i][:n], top[1][i][:n])) if n else []
            out.append(SampledToken(rid, tokens[i], token_lp[i], tops))
        return out

    def _noise(self, g: torch.Generator) -> torch.Tensor:
        return torch.empty(self.vocab_size).exponential_(generator=g)

    def _sample_row(self, row: torch.Tensor, spec: SamplingSpec, g: torch.Generator) -> int:
        row = row / spec.temperature
        if spec.min_p > 0:  # vLLM's: after temperature, before top-k / top-p
            probs = torch.softmax(row, dim=-1)
            row = row.masked_fill(probs < spec.min_p * probs.max(), float("-inf"))
        if 0 < spec.top_k < row.shape[-1]:
            kth = row.topk(spec.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        probs = torch.softmax(row, dim=-1)
        if spec.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            before = sorted_probs.cumsum(-1) - sorted_probs  # mass strictly above each token
            drop = before >= spec.top_p
            drop[0] = False
            probs = probs.clone()
            probs[order[drop]] = 0.0
        return int((probs / self._noise(g)).argmax())


def score_prompt(chunk: ScheduledChunk, logits: torch.Tensor) -> PromptLogprobs:
    """logits [rows, vocab]: row i predicts `chunk.prompt_targets[i]`, the prompt token at position
    `chunk.start_pos + 1 + i`. Its logprob, its rank (1 + how many tokens were more likely, as
    vLLM counts) and the `num_prompt_logprobs` most likely tokens."""
    logprobs = torch.log_softmax(logits, dim=-1)
    targets = torch.tensor(chunk.prompt_targets, dtype=torch.long)
    chosen = logprobs.gather(1, targets[:, None])  # [rows, 1]
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    top: list[list[tuple[int, float]]] = [[] for _ in chunk.prompt_targets]
    if chunk.num_prompt_logprobs:
        values, indices = logprobs.topk(chunk.num_prompt_logprobs, dim=-1)
        top = [list(zip(i, v)) for i, v in zip(indices.tolist(), values.tolist())]
    return PromptLogprobs(chunk.request_id, chunk.start_pos + 1, chosen[:, 0].tolist(), ranks.tolist(), top)
