"""Incremental detokenization and stop strings, per request.

Engine process, once per generated token. Text is emitted only in whole UTF-8 characters (a token
that ends inside a character waits for the next), and while stop strings are set the last
`len(longest stop) - 1` characters are held back so a client never sees the start of a stop string.
"""

from __future__ import annotations

from pdserve.text.tokenizer import Tokenizer

_CONTEXT_TOKENS = 5  # prompt tokens decoded with the output so leading spaces come out right


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool):
        self.tokenizer = tokenizer
        self.skip_special = skip_special_tokens
        self.ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def add(self, token_id: int) -> str:
        """New text made complete by this token (possibly empty)."""
        self.ids.append(token_id)
        decode = self.tokenizer.decode
        prefix = decode(self.ids[self.prefix_offset:self.read_offset], self.skip_special)
        full = decode(self.ids[self.prefix_offset:], self.skip_special)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            return full[len(prefix):]
        return ""

    def flush(self) -> str:
        """Whatever is still pending when the request ends (e.g. a cut-off character)."""
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset:self.read_offset], self.skip_special)
        full = self.tokenizer.decode(self.ids[self.prefix_offset:], self.skip_special)
        self.prefix_offset = self.read_offset = len(self.ids)
        return full[len(prefix):] if len(full) > len(prefix) else ""


def find_stop(text: str, new_len: int, stops: tuple[str, ...]) -> tuple[str, int] | None:
    """The first stop string that appears in `text` overlapping its last `new_len` characters:
    (stop, index where it starts)."""
    best = None
    for stop in stops:
        start = max(0, len(text) - new_len - len(stop) + 1)
        i = text.find(stop, start)
        if i != -1 and (best is None or i < best[1]):
            best = (stop, i)
    return best
