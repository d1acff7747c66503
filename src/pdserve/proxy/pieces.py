"""A rendered chat prompt's token ids, encoded as the pieces between its added tokens, each piece's
ids remembered: a conversation's next turn encodes only what is new in it.

Proxy process (event loop). A tokenizer cuts a text at its added tokens (`<|im_start|>`, ...)
before anything else and encodes the pieces between them independently, so the ids of a piece do
not depend on its neighbours; where a tokenizer's added tokens do not behave so
(`Tokenizer.splitting_tokens`), or a check finds a difference, every text is encoded whole. The
check runs on sample chats at start and on every `CHECK_EVERY`-th text after; ids that came out
wrong would only have misrouted requests (the instances tokenize for themselves).
"""

from __future__ import annotations

import collections
import logging
import re

from pdserve.text.tokenizer import Tokenizer

logger = logging.getLogger("pdserve.proxy")

MAX_PIECES = 4096  # remembered pieces (least recently used go first)
MAX_PIECE_CHARS = 65536  # a longer piece is encoded but not remembered
CHECK_EVERY = 64  # one text in this many is also encoded whole and compared
SAMPLES = ([{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Hello, world!  Two spaces, digits 12345, ünïcödé and\n\nnew lines."},
            {"role": "assistant", "content": " A leading space, a trailing one "},
            {"role": "user", "content": "<|im_start|> is text here?\t"}],)


class PieceEncoder:
    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._pieces: collections.OrderedDict[str, list[int]] = collections.OrderedDict()
        self._count = 0
        split = tokenizer.splitting_tokens()
        self._split = split
        self._pattern = re.compile("|".join(re.escape(t) for t in sorted(split, key=len, reverse=True))) \
            if split else None
        if self._pattern is not None and not all(self._agrees(self._render(m)) for m in SAMPLES):
            self._disable("the sample chats")

    @property
    def enabled(self) -> bool:
        return self._pattern is not None

    def encode(self, text: str) -> list[int]:
        """`text`'s ids as `tokenizer.encode(text, add_special_tokens=False)` gives them."""
        if self._pattern is None:
            return self.tokenizer.encode(text, add_special_tokens=False)
        self._count += 1
        if self._count % CHECK_EVERY == 0 and not self._agrees(text):
            self._disable(f"a prompt of {len(text)} characters")
            return self.tokenizer.encode(text, add_special_tokens=False)
        return self._by_pieces(text)

    def _by_pieces(self, text: str) -> list[int]:
        out: list[int] = []
        pos = 0
        for m in self._pattern.finditer(text):
            if m.start() > pos:
                out += self._piece(text[pos:m.start()])
            out.append(self._split[m.group()])
            pos = m.end()
        if pos < len(text):
            out += self._piece(text[pos:])
        return out

    def _piece(self, piece: str) -> list[int]:
        ids = self._pieces.get(piece)
        if ids is not None:
            self._pieces.move_to_end(piece)
            return ids
        ids = self.tokenizer.encode(piece, add_special_tokens=False)
        if len(piece) <= MAX_PIECE_CHARS:
            self._pieces[piece] = ids
            if len(self._pieces) > MAX_PIECES:
                self._pieces.popitem(last=False)
        return ids

    def _agrees(self, text: str) -> bool:
        return self._by_pieces(text) == self.tokenizer.encode(text, add_special_tokens=False)

    def _render(self, messages: list[dict]) -> str:
        if not self.tokenizer.has_chat_template:
            return "".join(f"{t}{m['content']}" for t, m in zip(self._split, messages))
        return self.tokenizer.apply_chat_template(messages, True)

    def _disable(self, where: str) -> None:
        logger.warning("the tokenizer's pieces do not add up to its ids on %s: the proxy encodes every "
                       "prompt whole from now on", where)
        self._pattern = None
        self._pieces.clear()
