"""The grammar state of each constrained request, and the bitmask it puts on its logits row.

TP rank 0 (the sampler), once per step. The vocabulary is read from the checkpoint's tokenizer.json
on the first constrained request (a process without one pays nothing). A request's matcher starts
from a compiled copy cached by grammar, is advanced by the tokens generated before rank 0 knew the
request (a P/D consumer's first token, `prefix_ids`) and then by each sampled token. When the
grammar is complete it allows only the end-of-sequence tokens, so the engine's usual EOS stop ends
the request.
"""

from __future__ import annotations

import collections
import logging
from pathlib import Path

import numpy as np
import torch

from pdserve.sampling_params import StructuredOutputs
from pdserve.structured.grammar import grammar_text

logger = logging.getLogger(__name__)
_CACHED_GRAMMARS = 64
_NEG_INF = torch.tensor(float("-inf"))


class _Failed:
    """The matcher of a request whose grammar failed here: it allows only end-of-sequence."""

    def is_error(self) -> bool:
        return True

    def is_stopped(self) -> bool:
        return True

    def consume_tokens(self, token_ids: list[int]) -> bool:
        return False

    def get_error(self) -> str:
        return "the grammar did not compile"


class Matchers:
    def __init__(self, model_dir: str | Path, vocab_size: int, eos_token_ids: tuple[int, ...]):
        self.model_dir = Path(model_dir)
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self._tokenizer = None
        self._compiled: collections.OrderedDict[str, object] = collections.OrderedDict()
        self.active: dict[str, object] = {}  # request id -> llguidance.LLMatcher

    def __bool__(self) -> bool:
        return bool(self.active)

    def add(self, request_id: str, structured: StructuredOutputs, prefix_ids: list[int]) -> None:
        """Never raises (a step must not fail for one request): a grammar that will not compile
        here, or first tokens it refuses, leave the request only its end-of-sequence tokens."""
        try:
            matcher = self._compile(grammar_text(structured)).deep_copy()
        except Exception as e:  # noqa: BLE001 - validated by the server already; logged, and ended
            logger.error("request %s: its grammar does not compile: %s", request_id, e)
            matcher = _Failed()
        if prefix_ids and not matcher.consume_tokens(prefix_ids):
            logger.error("request %s: its first tokens do not follow its grammar: %s", request_id,
                         matcher.get_error())
        self.active[request_id] = matcher

    def remove(self, request_id: str) -> None:
        self.active.pop(request_id, None)

    def mask(self, logits: torch.Tensor, request_ids: list[str]) -> None:
        """logits [rows, vocab], in place: every token a row's grammar does not allow -> -inf. The
        constrained rows' bitmasks are filled side by side and applied in one pass."""
        rows = [i for i, rid in enumerate(request_ids) if rid in self.active]
        if not rows:
            return
        words = (self.vocab_size + 31) // 32
        bitmask = np.zeros((len(rows), words), dtype=np.uint32)  # [rows, vocab / 32], bit t = token t
        for j, i in enumerate(rows):
            matcher = self.active[request_ids[i]]
            if matcher.is_error():  # cannot happen to a masked row; end the request rather than guess
                for t in self.eos_token_ids:
                    bitmask[j, t // 32] |= np.uint32(1 << (t % 32))
            else:
                matcher.unsafe_compute_mask_ptr(bitmask[j].ctypes.data, words * 4)
        bits = np.unpackbits(bitmask.view(np.uint8), axis=1, count=logits.shape[1], bitorder="little")
        allowed = torch.from_numpy(bits).view(torch.bool)  # [rows, vocab]
        with torch.inference_mode():  # the model's logits are inference tensors
            if len(rows) == logits.shape[0]:
                torch.where(allowed, logits, _NEG_INF, out=logits)
            else:
                index = torch.tensor(rows)
                logits[index] = torch.where(allowed, logits[index], _NEG_INF)

    def accept(self, request_ids: list[str], token_ids: list[int]) -> None:
        for rid, token in zip(request_ids, token_ids):
            matcher = self.active.get(rid)
            if matcher is not None and not matcher.is_stopped():
                matcher.consume_token(token)

    def _compile(self, text: str):
        from llguidance import LLMatcher
        matcher = self._compiled.get(text)
        if matcher is None:
            matcher = LLMatcher(self.tokenizer(), text, log_level=0)
            if matcher.is_error():
                raise ValueError(matcher.get_error())
            self._compiled[text] = matcher
            if len(self._compiled) > _CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
        self._compiled.move_to_end(text)
        return matcher

    def tokenizer(self):
        if self._tokenizer is None:
            from llguidance import LLTokenizer
            self._tokenizer = LLTokenizer((self.model_dir / "tokenizer.json").read_text(),
                                          n_vocab=self.vocab_size, eos_token=self.eos_token_ids or None)
        return self._tokenizer
