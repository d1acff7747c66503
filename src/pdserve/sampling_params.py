"""`SamplingParams`: what to generate, in vLLM's shape. Validated on construction (errors name the field)."""

from __future__ import annotations

import dataclasses
import math


class InvalidRequestError(ValueError):
    """Bad input from a client. `field` names the offending parameter; maps to HTTP 400."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


MAX_LOGPROBS = 20
MAX_N = 128
MAX_STOP = 64  # stop strings, and stop token ids
INT32 = 2 ** 31 - 1
SEED_MIN, SEED_MAX = -(2 ** 63), 2 ** 63 - 1 - MAX_N  # seed + i for the n samples fits an int64


STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclasses.dataclass(frozen=True)
class StructuredOutputs:
    """A constraint on the output (vLLM's `structured_outputs`): `kind` in STRUCTURED_KINDS, `value`
    the schema (JSON text), regex, choices (a JSON list) or grammar; `field` names it in errors."""

    kind: str
    value: str = ""
    field: str = "structured_outputs"

    def __post_init__(self):
        if self.kind not in STRUCTURED_KINDS:
            raise InvalidRequestError(self.field, f"must be one of {', '.join(STRUCTURED_KINDS)}")


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
    structured: StructuredOutputs | None = None  # the output follows this grammar (structured/)

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        # Every bound is one the engine can carry (a 64-bit seed, 32-bit counts): a number that
        # passed here never fails later, deeper, where it could take the engine down.
        if not 1 <= self.n <= MAX_N:
            raise InvalidRequestError("n", f"must be in [1, {MAX_N}], got {self.n}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise InvalidRequestError("temperature", f"must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise InvalidRequestError("top_p", f"must be in (0, 1], got {self.top_p}")
        if not -1 <= self.top_k <= INT32:
            raise InvalidRequestError("top_k", f"must be -1, 0 (disabled) or a positive 32-bit integer, "
                                               f"got {self.top_k}")
        if self.max_tokens is not None and not 1 <= self.max_tokens <= INT32:
            raise InvalidRequestError("max_tokens", f"must be in [1, {INT32}], got {self.max_tokens}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise InvalidRequestError("logprobs", f"must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if len(self.stop) > MAX_STOP or any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidRequestError("stop", f"must be at most {MAX_STOP} non-empty strings")
        if len(self.stop_token_ids) > MAX_STOP or any(
                isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= INT32 for t in self.stop_token_ids):
            raise InvalidRequestError("stop_token_ids", f"must be at most {MAX_STOP} token ids in [0, {INT32}]")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not SEED_MIN <= self.seed <= SEED_MAX):
            raise InvalidRequestError("seed", f"must be an integer in [{SEED_MIN}, {SEED_MAX}], got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5
