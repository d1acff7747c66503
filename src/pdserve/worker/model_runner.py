"""Turns one step's scheduled chunks into tensors and runs the model over the paged cache.

Runs in every TP rank, once per step. Multi-token chunks (prompts, prompt chunks, recomputes) are
laid out first, single-token decodes after them, so decodes share one batched attention call.
"""

from __future__ import annotations

import numpy as np
import torch

from pdserve.model.attention import AttentionMetadata, PrefillSeq, build_mask
from pdserve.model.llama import CausalLM
from pdserve.worker.kv_cache import KVCache
from pdserve.worker.messages import ScheduledChunk


class ModelRunner:
    def __init__(self, model: CausalLM, kv_cache: KVCache):
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = kv_cache.layout.block_size
        self.sliding_window = model.spec.sliding_window

    def execute(self, chunks: list[ScheduledChunk]) -> tuple[torch.Tensor | None, list[str], list]:
        """Run one step. Returns (logits [sampled rows, vocab] on rank 0, request ids of those rows,
        (chunk, logits [its scored rows, vocab]) for the chunks that score their prompt tokens).
        Only those chunks' other rows go through the LM head."""
        hidden, ordered = self._forward(chunks)
        rows, sampled_ids, scored, row = [], [], [], 0
        for c in ordered:
            if c.prompt_targets:
                scored.append((c, list(range(row, row + len(c.prompt_targets)))))
            row += len(c.token_ids)
            if c.sample:
                rows.append(row - 1)
                sampled_ids.append(c.request_id)
        prompt_rows = [r for _, rs in scored for r in rs]
        if not rows and not prompt_rows:
            return None, [], []
        logits = self.model.compute_logits(hidden[rows + prompt_rows])
        if logits is None:  # not rank 0
            return None, sampled_ids, []
        out, at = [], len(rows)
        for c, rs in scored:
            out.append((c, logits[at:at + len(rs)]))
            at += len(rs)
        return logits[:len(rows)], sampled_ids, out


    def score(self, token_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """One prefill of `token_ids` from position 0 (it overwrites the cache's first blocks): the
        log-probability of each next token and the most likely one, [len - 1] each, on rank 0 (for
        perplexity; bench/quality.py)."""
        blocks = list(range(-(-len(token_ids) // self.block_size)))
        hidden, _ = self._forward([ScheduledChunk("score", token_ids, 0, blocks, False)])
        logits = self.model.compute_logits(hidden[:-1])
        if logits is None:
            return None
        logprobs = torch.log_softmax(logits, dim=-1)
        nxt = torch.tensor(token_ids[1:], dtype=torch.long)
        return logprobs.gather(1, nxt[:, None])[:, 0], logits.argmax(dim=-1)

    def _forward(self, chunks: list[ScheduledChunk]) -> tuple[torch.Tensor, list[ScheduledChunk]]:
        """Hidden states [tokens, hidden] of every chunk, prefills first, and that order."""
        prefills = [c for c in chunks if len(c.token_ids) > 1]
        decodes = [c for c in chunks if len(c.token_ids) == 1]
        ordered = prefills + decodes
        token_ids, positions = [], []
        for c in ordered:
            token_ids.extend(c.token_ids)
            positions.extend(range(c.start_pos, c.start_pos + len(c.token_ids)))
        input_ids = torch.tensor(token_ids, dtype=torch.long)
        pos = torch.tensor(positions, dtype=torch.long)
        meta = self._metadata(prefills, decodes, pos)
        return self.model.forward(input_ids, pos, self.kv_cache.layers, meta), ordered

    def _metadata(self, prefills, decodes, pos: torch.Tensor) -> AttentionMetadata:
        bs = self.block_size
        slot_blocks, row = [], 0
        for c in prefills + decodes:
            for p in range(c.start_pos, c.start_pos + len(c.token_ids)):
                slot_blocks.append(c.block_ids[p // bs])
        seqs = []
        for c in prefills:
            n = len(c.token_ids)
            context_len = c.start_pos + n
            mask = None
            if c.start_pos > 0 or self.sliding_window is not None:
                mask = build_mask(pos[row: row + n], context_len, self.sliding_window)
            blocks = torch.tensor(c.block_ids[: -(-context_len // bs)], dtype=torch.long)
            seqs.append(PrefillSeq(row, n, context_len, blocks, mask))
            row += n
        tables = lens = None
        if decodes:
            lengths = [-(-(c.start_pos + 1) // bs) for c in decodes]
            table = np.zeros((len(decodes), max(lengths)), dtype=np.int64)
            for i, (c, n) in enumerate(zip(decodes, lengths)):
                table[i, :n] = c.block_ids[:n]
            tables = torch.from_numpy(table)
            lens = (pos[row:] + 1).to(torch.int32)
        return AttentionMetadata(
            slot_blocks=torch.tensor(slot_blocks, dtype=torch.long),
            slot_offsets=pos % bs,
            prefills=seqs,
            decode_start=row,
            decode_block_tables=tables,
            decode_context_lens=lens,
            sliding_window=self.sliding_window,
        )
