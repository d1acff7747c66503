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
MAX_BAD_WORDS = 128  # vLLM's VLLM_MAX_NUM_BAD_WORDS
MAX_LOGIT_BIAS = 1024  # entries; OpenAI allows 300
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
    prompt_logprobs: int | None = None  # top-n logprobs per prompt token (the prefix cache is skipped)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # logits controls, in vLLM's semantics (worker/logits_controls.py); the defaults change nothing
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # > 1 discourages tokens of the prompt and the output so far
    min_p: float = 0.0
    min_tokens: int = 0  # stop tokens (and EOS) are masked, stop strings ignored, until this many
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in [-100, 100]); a dict is accepted
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words: tuple[str, ...] = ()
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
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise InvalidRequestError("prompt_logprobs", f"must be in [0, {MAX_LOGPROBS}], got "
                                                         f"{self.prompt_logprobs}")
        if len(self.stop) > MAX_STOP or any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidRequestError("stop", f"must be at most {MAX_STOP} non-empty strings")
        if len(self.stop_token_ids) > MAX_STOP or any(
                isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= INT32 for t in self.stop_token_ids):
            raise InvalidRequestError("stop_token_ids", f"must be at most {MAX_STOP} token ids in [0, {INT32}]")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not SEED_MIN <= self.seed <= SEED_MAX):
            raise InvalidRequestError("seed", f"must be an integer in [{SEED_MIN}, {SEED_MAX}], got {self.seed!r}")
        self._check_controls()

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def has_logits_controls(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.min_tokens or self.logit_bias or self.allowed_token_ids is not None
                    or self.bad_words)

    def _check_controls(self) -> None:
        """vLLM's bounds; token ids against the vocabulary are the engine's check."""
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (_number(value) and -2 <= value <= 2):
                raise InvalidRequestError(name, f"must be in [-2, 2], got {value!r}")
        if not (_number(self.repetition_penalty) and self.repetition_penalty > 0):
            raise InvalidRequestError("repetition_penalty", f"must be a finite number > 0, got "
                                                            f"{self.repetition_penalty!r}")
        if not (_number(self.min_p) and 0 <= self.min_p <= 1):
            raise InvalidRequestError("min_p", f"must be in [0, 1], got {self.min_p!r}")
        if not (_token_id(self.min_tokens)):
            raise InvalidRequestError("min_tokens", f"must be in [0, {INT32}], got {self.min_tokens!r}")
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        try:
            bias = tuple(sorted((int(t), float(b)) for t, b in bias))
        except (TypeError, ValueError):
            raise InvalidRequestError("logit_bias", "must map token ids to numbers") from None
        if len(bias) > MAX_LOGIT_BIAS or not all(_token_id(t) and math.isfinite(b) for t, b in bias):
            raise InvalidRequestError("logit_bias", f"must map at most {MAX_LOGIT_BIAS} token ids in "
                                                    f"[0, {INT32}] to finite numbers")
        object.__setattr__(self, "logit_bias", tuple((t, min(100.0, max(-100.0, b))) for t, b in bias))
        if self.allowed_token_ids is not None:
            object.__setattr__(self, "allowed_token_ids", tuple(self.allowed_token_ids))
            if not self.allowed_token_ids or not all(_token_id(t) for t in self.allowed_token_ids):
                raise InvalidRequestError("allowed_token_ids", f"must be a non-empty list of token ids "
                                                               f"in [0, {INT32}]")
        object.__setattr__(self, "bad_words", tuple(self.bad_words or ()))
        if len(self.bad_words) > MAX_BAD_WORDS or any(not isinstance(w, str) or not w.strip()
                                                      for w in self.bad_words):
            raise InvalidRequestError("bad_words", f"must be at most {MAX_BAD_WORDS} non-empty strings")


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _token_id(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= INT32
