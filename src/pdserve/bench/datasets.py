"""Workloads for `pdserve bench serve`, seeded: the same arguments always give the same requests.

Any process (pure functions). Prompts are token ids (lengths are exact, whatever the tokenizer),
drawn from [`vocab_lo`, `vocab_hi`), with `ignore_eos` on the requests so output lengths are exact
too. Datasets: `random` (lengths uniform within ± range ratio, as vLLM's), `chat` (heavy-tailed
input and output lengths, like real chat traffic: log-normal, clipped), `mixed` (mostly short
prompts, some long ones: where prefill and decode compete), `prefix-sharing` (N shared system
prompts, each request picks one), `shared-prefix` (inference-perf's: groups of prompts sharing a
system prompt, shuffled), `multi-turn` (sessions whose turns carry the history: the client puts
the previous prompt and answer first), `trace` (a Mooncake JSONL trace, bench/trace.py), `jsonl`
(one {"prompt", "output_len"} per line).
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
from pathlib import Path

from pdserve.bench.trace import BlockPrompt, read_trace, scaled_length


@dataclasses.dataclass(frozen=True)
class BenchRequest:
    prompt: list[int] | str | BlockPrompt  # multi-turn, from the second turn: the new user tokens only
    prompt_len: int  # the whole prompt (multi-turn: with the history, each answer output_len long)
    output_len: int
    session_id: str | None = None  # a session's requests are sent one after another, in order
    with_history: bool = False  # the session's previous prompt and answer come first
    think_time_s: float = 0.0  # the pause after the session's previous answer
    arrival_s: float | None = None  # not before this many seconds into the run (trace)


@dataclasses.dataclass(frozen=True)
class SharedPrefixArgs:
    """inference-perf's `shared_prefix`: num_groups x prompts_per_group prompts."""

    num_groups: int = 4
    prompts_per_group: int = 8
    system_len: int = 256  # shared by the group's prompts
    question_len: int = 64  # each prompt's own
    output_len: int = 64

    def __post_init__(self):
        _check_positive(self, "--shared-prefix-", ("num_groups", "prompts_per_group", "question_len", "output_len"))


@dataclasses.dataclass(frozen=True)
class MultiTurnArgs:
    num_sessions: int = 8
    num_turns: int = 4
    system_len: int = 256  # each session's own system prompt
    user_len: int = 64  # new tokens of each user turn
    answer_len: int = 64
    think_time_s: float = 1.0  # between an answer and the next turn: fixed, or exponential with this mean
    think_time_dist: str = "exponential"

    def __post_init__(self):
        _check_positive(self, "--multi-turn-", ("num_sessions", "num_turns", "user_len", "answer_len"))
        if self.system_len < 0 or not self.think_time_s >= 0:
            raise ValueError("--multi-turn-system-len and --multi-turn-think-time-s must be >= 0")
        if self.think_time_dist not in ("fixed", "exponential"):
            raise ValueError(f"--multi-turn-think-time-dist: fixed or exponential, got {self.think_time_dist!r}")


@dataclasses.dataclass(frozen=True)
class TraceArgs:
    block_tokens: int = 512  # token ids per hash id
    source_block_tokens: int = 512  # the trace's own tokens per hash id (Mooncake's 512)
    time_scale: float = 1.0  # multiplies the timestamps: 0.5 replays twice as fast
    max_input_len: int | None = None  # prompts cut to this many tokens

    def __post_init__(self):
        _check_positive(self, "--trace-", ("block_tokens", "source_block_tokens"))
        if not self.time_scale >= 0 or math.isinf(self.time_scale):
            raise ValueError(f"--trace-time-scale must be finite and >= 0, got {self.time_scale}")
        if self.max_input_len is not None and self.max_input_len < 1:
            raise ValueError(f"--max-input-len must be >= 1, got {self.max_input_len}")


def _check_positive(obj, flag_prefix: str, fields: tuple[str, ...]) -> None:
    for name in fields:
        if getattr(obj, name) < 1:
            flag = flag_prefix + name.replace("_", "-")
            raise ValueError(f"{flag} must be >= 1, got {getattr(obj, name)}")


@dataclasses.dataclass(frozen=True)
class DatasetArgs:
    name: str = "random"
    num_prompts: int | None = 100  # None: every row (trace, jsonl)
    seed: int = 0
    input_len: int = 256
    output_len: int = 64
    range_ratio: float = 0.0
    long_fraction: float = 0.25  # mixed: the share of long prompts
    long_len: int = 1536
    num_prefixes: int = 4  # prefix-sharing
    prefix_len: int = 256
    path: str | None = None  # jsonl, trace
    vocab_lo: int = 7  # past the special tokens of the generated models
    vocab_hi: int = 1000  # every model pdserve runs has at least this many tokens
    max_len: int = 2048  # prompt + output never past this
    shared_prefix: SharedPrefixArgs = dataclasses.field(default_factory=SharedPrefixArgs)
    multi_turn: MultiTurnArgs = dataclasses.field(default_factory=MultiTurnArgs)
    trace: TraceArgs = dataclasses.field(default_factory=TraceArgs)


@dataclasses.dataclass(frozen=True)
class Workload:
    requests: list[BenchRequest]
    info: dict  # what the run's result should say about the workload (e.g. trace rows skipped)


NAMES = ("random", "chat", "mixed", "prefix-sharing", "shared-prefix", "multi-turn", "trace", "jsonl")


def make(args: DatasetArgs) -> list[BenchRequest]:
    return build(args).requests


def build(args: DatasetArgs) -> Workload:
    """The requests, in the order their sessions start (ValueError on bad arguments or files)."""
    rng = random.Random(args.seed)
    builder = {"random": _random, "chat": _chat, "mixed": _mixed, "prefix-sharing": _prefix_sharing,
               "shared-prefix": _shared_prefix, "multi-turn": _multi_turn, "trace": _trace,
               "jsonl": _jsonl}.get(args.name)
    if builder is None:
        raise ValueError(f"unknown dataset {args.name!r}: {', '.join(NAMES)}")
    out = builder(args, rng)
    return out if isinstance(out, Workload) else Workload(out, {})


def _ids(args: DatasetArgs, rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(args.vocab_lo, args.vocab_hi) for _ in range(n)]


def _fit(args: DatasetArgs, prompt_len: int, output_len: int) -> tuple[int, int]:
    prompt_len = max(1, min(prompt_len, args.max_len - 2))
    return prompt_len, max(1, min(output_len, args.max_len - prompt_len))


def _request(args: DatasetArgs, rng: random.Random, prompt_len: int, output_len: int,
             prefix: list[int] = ()) -> BenchRequest:
    prompt_len, output_len = _fit(args, prompt_len, output_len)
    prompt = list(prefix)[:prompt_len] + _ids(args, rng, prompt_len - min(len(prefix), prompt_len))
    return BenchRequest(prompt, prompt_len, output_len)


def _uniform(rng: random.Random, length: int, ratio: float) -> int:
    return rng.randint(max(1, math.floor(length * (1 - ratio))), max(1, math.ceil(length * (1 + ratio))))


def _random(args, rng):
    return [_request(args, rng, _uniform(rng, args.input_len, args.range_ratio),
                     _uniform(rng, args.output_len, args.range_ratio)) for _ in range(args.num_prompts)]


def _chat(args, rng):
    """Log-normal lengths with the given medians (σ = 1 for prompts, 0.8 for answers)."""
    return [_request(args, rng, max(4, round(rng.lognormvariate(math.log(args.input_len), 1.0))),
                     max(1, round(rng.lognormvariate(math.log(args.output_len), 0.8))))
            for _ in range(args.num_prompts)]


def _mixed(args, rng):
    out = []
    for _ in range(args.num_prompts):
        long = rng.random() < args.long_fraction
        n = _uniform(rng, args.long_len if long else args.input_len, 0.25)
        out.append(_request(args, rng, n, _uniform(rng, args.output_len, 0.25)))
    return out


def _prefix_sharing(args, rng):
    prefixes = [_ids(args, rng, args.prefix_len) for _ in range(args.num_prefixes)]
    return [_request(args, rng, args.prefix_len + _uniform(rng, args.input_len, args.range_ratio),
                     _uniform(rng, args.output_len, args.range_ratio), prefix=rng.choice(prefixes))
            for _ in range(args.num_prompts)]


def _shared_prefix(args, rng):
    sp = args.shared_prefix
    out = []
    for _ in range(sp.num_groups):
        system = _ids(args, rng, sp.system_len)
        out += [_request(args, rng, sp.system_len + sp.question_len, sp.output_len, prefix=system)
                for _ in range(sp.prompts_per_group)]
    rng.shuffle(out)
    return out


def _multi_turn(args, rng):
    """Session by session; turn k > 0 holds only its new user tokens, the client adds the history."""
    mt = args.multi_turn
    need = mt.system_len + mt.num_turns * (mt.user_len + mt.answer_len)
    if need > args.max_len:
        raise ValueError(f"multi-turn: a session's last turn needs {need} tokens (system + turns x (user + "
                         f"answer)), past --max-model-len {args.max_len}")
    out = []
    for s in range(mt.num_sessions):
        new, length = _ids(args, rng, mt.system_len), 0
        for turn in range(mt.num_turns):
            new += _ids(args, rng, mt.user_len)
            length += len(new) + (mt.answer_len if turn else 0)
            think = 0.0 if turn == 0 else mt.think_time_s if mt.think_time_dist == "fixed" \
                else rng.expovariate(1 / mt.think_time_s) if mt.think_time_s else 0.0
            out.append(BenchRequest(new, length, mt.answer_len, session_id=f"session-{s}",
                                    with_history=turn > 0, think_time_s=think))
            new = []
    return out


def _trace(args, rng):
    """Rows in timestamp order (the first --num-prompts), sent at their scaled timestamps; a row's
    session_id makes its session's rows wait for one another."""
    if not args.path:
        raise ValueError("--dataset-name trace needs --dataset-path FILE.jsonl")
    rows, skipped = read_trace(args.path)
    rows = rows if args.num_prompts is None else rows[:args.num_prompts]
    tr, out = args.trace, []
    for i, row in enumerate(rows):
        n = scaled_length(row.input_length, tr.block_tokens, tr.source_block_tokens)
        n, output_len = _fit(args, min(n, tr.max_input_len or n), row.output_length)
        prompt = BlockPrompt(row.hash_ids, n, tr.block_tokens, f"row:{args.seed}:{i}", args.vocab_lo, args.vocab_hi)
        arrival = (row.timestamp_ms - rows[0].timestamp_ms) / 1000 * tr.time_scale
        out.append(BenchRequest(prompt, n, output_len, session_id=row.session_id, arrival_s=arrival))
    return Workload(out, {"trace_rows": len(rows), "trace_rows_skipped": skipped})


def _jsonl(args, rng):
    if not args.path:
        raise ValueError("--dataset-name jsonl needs --dataset-path")
    out = []
    for line in Path(args.path).read_text().splitlines():
        if line.strip():
            item = json.loads(line)
            prompt = item["prompt"]
            n = len(prompt) if isinstance(prompt, list) else max(1, len(prompt) // 4)
            out.append(BenchRequest(prompt, n, int(item.get("output_len") or item.get("max_tokens") or args.output_len)))
    rng.shuffle(out)
    return out[:args.num_prompts]
