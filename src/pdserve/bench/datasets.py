"""Workloads for `pdserve bench serve`, seeded: the same arguments always give the same requests.

Any process (pure functions). Prompts are token ids (lengths are exact, whatever the tokenizer),
drawn from [`vocab_lo`, `vocab_hi`), with `ignore_eos` on the requests so output lengths are exact
too. Datasets: `random` (lengths uniform within ± range ratio, as vLLM's), `chat` (heavy-tailed
input and output lengths, like real chat traffic: log-normal, clipped), `mixed` (mostly short
prompts, some long ones: where prefill and decode compete), `prefix-sharing` (N shared system
prompts, distinct suffixes), `jsonl` (one {"prompt", "output_len"} per line).
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class BenchRequest:
    prompt: list[int] | str
    prompt_len: int
    output_len: int


@dataclasses.dataclass(frozen=True)
class DatasetArgs:
    name: str = "random"
    num_prompts: int = 100
    seed: int = 0
    input_len: int = 256
    output_len: int = 64
    range_ratio: float = 0.0
    long_fraction: float = 0.25  # mixed: the share of long prompts
    long_len: int = 1536
    num_prefixes: int = 4  # prefix-sharing
    prefix_len: int = 256
    path: str | None = None  # jsonl
    vocab_lo: int = 7  # past the special tokens of the generated models
    vocab_hi: int = 1000  # every model pdserve runs has at least this many tokens
    max_len: int = 2048  # prompt + output never past this


def make(args: DatasetArgs) -> list[BenchRequest]:
    rng = random.Random(args.seed)
    build = {"random": _random, "chat": _chat, "mixed": _mixed, "prefix-sharing": _prefix_sharing,
             "jsonl": _jsonl}.get(args.name)
    if build is None:
        raise ValueError(f"unknown dataset {args.name!r}: random, chat, mixed, prefix-sharing, jsonl")
    return build(args, rng)


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
