"""Conditional disaggregation: per request, prefill on a producer (remote) or let the decode instance
prefill it itself (local), from the prompt's length and the queues the instances report.

Proxy process (pure). Short prompts cost decode little, and its spare time then serves them with no
transfer and no wait in a producer's queue; long prompts still go to producers, so they never stall
decode's running streams, unless every producer is far busier than decode.
"""

from __future__ import annotations

import dataclasses

REMOTE, LOCAL = "remote", "local"
CHARS_PER_TOKEN = 4  # a text prompt's length in tokens, estimated without a tokenizer


@dataclasses.dataclass(frozen=True)
class DisaggPolicy:
    local_max_tokens: int = 0  # prompts up to this long may prefill on decode; 0: always remote
    decode_queue_max: int = 2  # ... while decode has at most this many requests waiting
    prefill_queue_max: int = 8  # a prompt up to 4x local_max_tokens goes local when every producer
    # has more than this many waiting and decode none

    def decide(self, prompt_tokens: int | None, decode_queued: int, prefill_queued: int) -> str:
        if self.local_max_tokens <= 0 or prompt_tokens is None:
            return REMOTE
        if prompt_tokens <= self.local_max_tokens and decode_queued <= self.decode_queue_max:
            return LOCAL
        if prompt_tokens <= 4 * self.local_max_tokens and decode_queued == 0 \
                and prefill_queued > self.prefill_queue_max:
            return LOCAL
        return REMOTE


def prompt_tokens(body: dict) -> int | None:
    """Tokens in the request's one prompt (exact for token ids, estimated for text); None for
    anything else (several prompts): those go remote."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return len(prompt)
    if isinstance(prompt, str):
        return len(prompt) // CHARS_PER_TOKEN + 1
    messages = body.get("messages")
    if isinstance(messages, list):
        chars = sum(_content_chars(m.get("content")) for m in messages if isinstance(m, dict))
        return chars // CHARS_PER_TOKEN + 8 * len(messages)  # the template adds a few tokens per turn
    return None


def _content_chars(content) -> int:
    """Characters of a message's content: a string, or a list of parts (the text parts count)."""
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        return sum(len(part["text"]) for part in content
                   if isinstance(part, dict) and isinstance(part.get("text"), str))
    return 0
