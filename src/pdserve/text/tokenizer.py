"""Tokenizer of a checkpoint directory: `tokenizer.json` via the `tokenizers` library, special
tokens from `tokenizer_config.json`, and its chat templates (chat_template.py).

Server and engine processes. transformers is not needed at run time (it is slow to import).
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer

from pdserve.text.chat_template import ChatRenderer, find_templates


def _token_text(value) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


class Tokenizer:
    def __init__(self, model_dir: str | Path, chat_template: str | None = None):
        """`chat_template`: a template file or text that wins over the checkpoint's own."""
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {model_dir}")
        self._tok = HFTokenizer.from_file(str(path))
        cfg_path = model_dir / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        special = {name: _token_text(cfg.get(name)) or "" for name in ("bos_token", "eos_token",
                                                                       "unk_token", "pad_token")}
        self.chat = ChatRenderer(*find_templates(model_dir, cfg, chat_template), special)
        self.has_chat_template = self.chat.has_template
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        self.vocab_size = self._tok.get_vocab_size()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def splitting_tokens(self) -> dict[str, int] | None:
        """The added tokens (text -> id) a text is cut at before anything else is done to it, when
        the pieces between them are then encoded each on its own: none strips the spaces beside it,
        matches whole words only or matches normalised text. None when one does."""
        added = self._tok.get_added_tokens_decoder()
        if any(a.lstrip or a.rstrip or a.single_word or (a.normalized and self._tok.normalizer is not None)
               for a in added.values()):
            return None
        return {a.content: i for i, a in added.items()}

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """Text of one token for logprob listings. A token that is part of a multi-byte character
        shows as its vocabulary entry, so distinct tokens never share a key."""
        text = self._tok.decode([token_id], skip_special_tokens=False)
        if "\ufffd" in text:
            text = self._tok.id_to_token(token_id) or text
        return text

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            **options) -> str:
        """The prompt text (options: continue_final_message, chat_template, template_kwargs)."""
        return self.chat.render(messages, add_generation_prompt, **options)
