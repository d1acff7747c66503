"""Tokenizer of a checkpoint directory: `tokenizer.json` via the `tokenizers` library, plus the
chat template and special tokens from `tokenizer_config.json`.

Server and engine processes. transformers is not needed at run time (it is slow to import).
"""

from __future__ import annotations

import json
from pathlib import Path

import jinja2.sandbox
from tokenizers import Tokenizer as HFTokenizer

# Used when the checkpoint's tokenizer config has no chat template (documented in the README).
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def _token_text(value) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


class Tokenizer:
    def __init__(self, model_dir: str | Path):
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {model_dir}")
        self._tok = HFTokenizer.from_file(str(path))
        cfg_path = model_dir / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        self.has_chat_template = template is not None
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_template_error
        self._chat_template = env.from_string(template or DEFAULT_CHAT_TEMPLATE)
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        self.vocab_size = self._tok.get_vocab_size()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """Text of one token for logprob listings. A token that is part of a multi-byte character
        shows as its vocabulary entry, so distinct tokens never share a key."""
        text = self._tok.decode([token_id], skip_special_tokens=False)
        if "\ufffd" in text:
            text = self._tok.id_to_token(token_id) or text
        return text

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        return self._chat_template.render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "", eos_token=self.eos_token or "")


class ChatTemplateError(ValueError):
    pass


def _raise_template_error(message: str):
    raise ChatTemplateError(message)
