"""A request's logits controls as rank 0's sampler takes them (`LogitsControls`): token ids checked
against the vocabulary, bad words tokenized as vLLM does, min_tokens' stop ids (EOS included).

Engine process, once per request at `add_request` (raises InvalidRequestError naming the field); the
scheduler adds the request's history when it first sends it to the ranks (`with_history`).
"""

from __future__ import annotations

import msgspec

from pdserve.sampling_params import InvalidRequestError, SamplingParams
from pdserve.text.tokenizer import Tokenizer
from pdserve.worker.messages import LogitsControls


def logits_controls(params: SamplingParams, tokenizer: Tokenizer, eos_token_ids: tuple[int, ...],
                    vocab_size: int, producer: bool = False) -> LogitsControls | None:
    """None when the request has no control (its rows then cost the sampler nothing). A P/D
    producer stops after its first token whatever max_tokens says, so min_tokens is not held to it
    (vLLM's proxies send the producer max_tokens 1)."""
    if not producer and params.max_tokens is not None and params.min_tokens > params.max_tokens:
        raise InvalidRequestError("min_tokens", f"must be at most max_tokens ({params.max_tokens}), "
                                                f"got {params.min_tokens}")
    if not params.has_logits_controls:
        return None
    for field, ids in (("logit_bias", [t for t, _ in params.logit_bias]),
                       ("allowed_token_ids", params.allowed_token_ids or ())):
        if any(t >= vocab_size for t in ids):
            raise InvalidRequestError(field, f"token ids must be in [0, {vocab_size})")
    return LogitsControls(
        logit_bias=list(params.logit_bias),
        allowed_token_ids=list(params.allowed_token_ids) if params.allowed_token_ids is not None else None,
        bad_words_token_ids=bad_words_token_ids(params.bad_words, tokenizer, vocab_size),
        min_tokens=params.min_tokens,
        min_tokens_stop_ids=sorted(set(params.stop_token_ids) | set(eos_token_ids)) if params.min_tokens else [],
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty)


def bad_words_token_ids(words: tuple[str, ...], tokenizer: Tokenizer, vocab_size: int) -> list[list[int]]:
    """vLLM's: each word as it would start the text, and with a leading space when that is another
    token sequence of the same length (so the word is banned at the start and mid-text)."""
    out: list[list[int]] = []
    for word in words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        if not plain:
            raise InvalidRequestError("bad_words", f"{word!r} is no token")
        out.append(plain)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    if any(t >= vocab_size for ids in out for t in ids):
        raise InvalidRequestError("bad_words", f"a word's token ids fall outside the model's vocabulary "
                                               f"({vocab_size})")
    return out


def with_history(controls: LogitsControls, prompt_token_ids: list[int],
                 output_token_ids: list[int]) -> LogitsControls:
    """What rank 0 counts from: the prompt for repetition_penalty, and tokens generated before the
    ranks knew the request (a P/D consumer's first token, made by the producer)."""
    prompt = list(prompt_token_ids) if controls.repetition_penalty != 1.0 else None
    return msgspec.structs.replace(controls, prompt_token_ids=prompt, output_token_ids=list(output_token_ids))
