"""`SamplingParams`: what to generate, in vLLM's shape. Validated on construction (errors name the field)."""

from __future__ import annotations

import dataclasses


class InvalidRequestError(ValueError):
    """Bad input from a client. `field` names the offending parameter; maps to HTTP 400."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


MAX_LOGPROBS = 20


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the context length
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # top-n logprobs per generated token; 0 = only the sampled token
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        if self.n < 1:
            raise InvalidRequestError("n", f"must be at least 1, got {self.n}")
        if not self.temperature >= 0:
            raise InvalidRequestError("temperature", f"must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise InvalidRequestError("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise InvalidRequestError("top_k", f"must be -1, 0 (disabled) or positive, got {self.top_k}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise InvalidRequestError("max_tokens", f"must be at least 1, got {self.max_tokens}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise InvalidRequestError("logprobs", f"must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidRequestError("stop", "must be non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise InvalidRequestError("stop_token_ids", "must be non-negative integers")
        if self.seed is not None and not isinstance(self.seed, int):
            raise InvalidRequestError("seed", f"must be an integer, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5
