"""What the engine returns: per-step deltas (`RequestOutput`) and, offline, whole completions."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] | None  # (token id, logprob), best first
    rank: int | None = None  # of a prompt token: 1 + how many tokens were more likely


@dataclasses.dataclass
class RequestOutput:
    """What one engine step added to one request (a delta; `LLM` accumulates it)."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    new_logprobs: list[TokenLogprob] | None
    finished: bool = False
    finish_reason: str | None = None  # "stop", "length", "abort", "error"
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    kv_transfer_params: dict | None = None
    error: str | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None  # with the first token, if asked
    # time.monotonic() of the engine's thread (the server's clock): when the request arrived in the
    # engine, and when it first ran (None until then)
    arrival_time: float | None = None
    scheduled_time: float | None = None


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None
    stop_reason: str | int | None = None


@dataclasses.dataclass
class GenerationOutput:
    """One prompt's finished result from `LLM.generate` (vLLM calls this RequestOutput)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0
