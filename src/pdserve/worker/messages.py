"""Messages between the engine and its TP ranks (one step down, one report up per rank).

Engine process <-> TP rank processes, msgpack over a pipe. The connector parts are opaque to this
module: their types live in kv_transfer/messages.py.
"""

from __future__ import annotations

import msgspec

from pdserve.kv_transfer.messages import ConnectorMetadata, ConnectorReport, RankAgent


class GrammarSpec(msgspec.Struct, frozen=True):
    """A structured-output constraint (sampling_params.StructuredOutputs) and the tokens it has
    already accepted elsewhere (a P/D consumer's first token): rank 0's matcher resumes from them."""

    kind: str
    value: str
    prefix_ids: list[int] = []


class LogitsControls(msgspec.Struct, frozen=True):
    """A request's controls that change its logits before sampling, in vLLM's semantics
    (worker/logits_controls.py), and the history they count. A request with none has no struct."""

    logit_bias: list[tuple[int, float]] = []
    allowed_token_ids: list[int] | None = None
    bad_words_token_ids: list[list[int]] = []  # each banned as its last token after the others
    min_tokens: int = 0
    min_tokens_stop_ids: list[int] = []  # masked while fewer outputs: stop_token_ids and EOS
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    prompt_token_ids: list[int] | None = None  # repetition_penalty counts the prompt's tokens
    output_token_ids: list[int] = []  # generated before rank 0 knew it (a P/D consumer's first)


class SamplingSpec(msgspec.Struct, frozen=True):
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    num_logprobs: int | None
    num_presampled: int = 0  # tokens already drawn elsewhere (the P/D producer's first token)
    min_p: float = 0.0
    controls: LogitsControls | None = None
    grammar: GrammarSpec | None = None  # structured outputs: the sampler masks by it (structured/)


class NewRequest(msgspec.Struct, frozen=True):
    request_id: str
    sampling: SamplingSpec


class ScheduledChunk(msgspec.Struct, frozen=True):
    request_id: str
    token_ids: list[int]  # the tokens whose K/V this step computes
    start_pos: int  # position of token_ids[0]
    block_ids: list[int]  # the request's whole block table
    sample: bool  # the last token's logits produce a new token
    # prompt logprobs: the prompt tokens its rows predict (row i -> prompt_targets[i]), and how many
    # of the most likely tokens each row reports; empty for every other request
    prompt_targets: list[int] = []
    num_prompt_logprobs: int = 0


class StepInput(msgspec.Struct, tag="step"):
    step_id: int
    chunks: list[ScheduledChunk]
    new_requests: list[NewRequest]
    finished_request_ids: list[str]
    connector: ConnectorMetadata | None = None


class SampledToken(msgspec.Struct, frozen=True):
    request_id: str
    token_id: int
    logprob: float
    top_logprobs: list[tuple[int, float]] | None


class PromptLogprobs(msgspec.Struct, frozen=True):
    """One chunk's prompt tokens scored: the log-probability and rank (1 = most likely) of each
    prompt token from position `start_pos`, and the most likely tokens there."""

    request_id: str
    start_pos: int
    logprobs: list[float]
    ranks: list[int]
    top: list[list[tuple[int, float]]]


class StepOutput(msgspec.Struct):
    rank: int
    sampled: list[SampledToken]  # rank 0 only
    prompt_logprobs: list[PromptLogprobs] = []  # rank 0 only
    connector: ConnectorReport | None = None
    error: str | None = None


class Shutdown(msgspec.Struct, tag="shutdown"):
    reason: str = ""


class DebugCall(msgspec.Struct, tag="debug"):
    """Test hooks run on every rank (e.g. checksum or perturb blocks); never used in serving."""

    name: str
    args: list = []


class DebugResult(msgspec.Struct):
    rank: int
    value: object = None
    error: str | None = None


class RankReady(msgspec.Struct):
    """A spawned rank's first message: loaded and registered, or the reason it could not start."""

    rank: int
    agent: RankAgent | None = None
    error: str | None = None
