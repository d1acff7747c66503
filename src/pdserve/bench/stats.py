"""The numbers of a serving benchmark, from what each request saw, in `vllm bench serve`'s names.

Any process (pure functions). A request's TTFT is the time to its first content chunk, its ITLs the
gaps between content chunks, its TPOT (E2EL − TTFT) / (output tokens − 1), its E2EL the time to the
last byte. Goodput counts requests that met every SLO given (`ttft`, `tpot`, `e2el`; `itl` is the
largest gap of the request, a pdserve addition), per second of the run. Sessions (multi-turn)
add the median TTFT of each turn.
"""

from __future__ import annotations

import dataclasses
import math

METRICS = ("ttft", "tpot", "itl", "e2el")


@dataclasses.dataclass
class RequestResult:
    prompt_len: int
    output_len: int = 0  # tokens generated (from the server's usage)
    ttft: float = 0.0  # seconds
    itls: list[float] = dataclasses.field(default_factory=list)  # seconds between content chunks
    e2el: float = 0.0
    success: bool = False
    error: str = ""
    start: float = 0.0  # seconds since the run began
    generated_text: str = ""
    pd_decision: str | None = None  # where a pdserve proxy had it prefilled (X-PD-Decision)
    session_id: str | None = None
    turn: int | None = None  # its place in its session (0: the first)
    cached_tokens: int | None = None  # prompt tokens the server did not compute (its usage says)

    @property
    def tpot(self) -> float | None:
        return (self.e2el - self.ttft) / (self.output_len - 1) if self.output_len > 1 else None


def chunk_times_to_result(prompt_len: int, start: float, chunk_times: list[float], end: float,
                          output_len: int) -> RequestResult:
    """A request from the arrival time of each content chunk (absolute seconds)."""
    r = RequestResult(prompt_len, output_len=output_len, start=start, success=True)
    if chunk_times:
        r.ttft = chunk_times[0] - start
        r.itls = [b - a for a, b in zip(chunk_times, chunk_times[1:])]
    r.e2el = end - start
    return r


def percentile(values: list[float], p: float) -> float:
    """Linear interpolation between closest ranks (numpy's default); 0 for no values."""
    if not values:
        return 0.0
    xs = sorted(values)
    k = (len(xs) - 1) * p / 100
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def parse_goodput(specs: list[str]) -> dict[str, float]:
    """`ttft:2000 itl:150` -> {"ttft": 2.0, "itl": 0.15} (milliseconds in, seconds out)."""
    slos = {}
    for spec in specs:
        name, _, ms = spec.partition(":")
        if name not in METRICS or not ms:
            raise ValueError(f"--goodput takes NAME:MS with NAME one of {', '.join(METRICS)}, got {spec!r}")
        slos[name] = float(ms) / 1000
    return slos


def is_good(r: RequestResult, slos: dict[str, float]) -> bool:
    if not r.success:
        return False
    values = {"ttft": r.ttft, "tpot": r.tpot or 0.0, "e2el": r.e2el, "itl": max(r.itls, default=0.0)}
    return all(values[name] <= limit for name, limit in slos.items())


def summarize(results: list[RequestResult], duration_s: float, slos: dict[str, float] | None = None,
              percentiles: tuple[float, ...] = (50, 90, 99)) -> dict:
    """The run's metrics, with vLLM's field names (`mean_ttft_ms`, `p99_itl_ms`, ...)."""
    ok = [r for r in results if r.success]
    out = {
        "duration": duration_s,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": sum(r.prompt_len for r in ok),
        "total_output_tokens": sum(r.output_len for r in ok),
        "request_throughput": len(ok) / duration_s if duration_s else 0.0,
        "output_throughput": sum(r.output_len for r in ok) / duration_s if duration_s else 0.0,
        "total_token_throughput": sum(r.prompt_len + r.output_len for r in ok) / duration_s if duration_s else 0.0,
    }
    if slos:
        good = sum(is_good(r, slos) for r in results)
        out["request_goodput"] = good / duration_s if duration_s else 0.0
        out["goodput_fraction"] = good / len(results) if results else 0.0
    values = {"ttft": [r.ttft for r in ok], "tpot": [r.tpot for r in ok if r.tpot is not None],
              "itl": [g for r in ok for g in r.itls], "e2el": [r.e2el for r in ok]}
    for name, xs in values.items():
        ms = [x * 1000 for x in xs]
        out[f"mean_{name}_ms"] = sum(ms) / len(ms) if ms else 0.0
        out[f"median_{name}_ms"] = percentile(ms, 50)
        mean = out[f"mean_{name}_ms"]
        out[f"std_{name}_ms"] = math.sqrt(sum((x - mean) ** 2 for x in ms) / len(ms)) if ms else 0.0
        for p in percentiles:
            out[f"p{p:g}_{name}_ms"] = percentile(ms, p)
    out["max_itl_per_request_ms"] = [max(r.itls, default=0.0) * 1000 for r in ok]
    out["input_lens"] = [r.prompt_len for r in results]
    out["output_lens"] = [r.output_len for r in results]
    out["ttfts"] = [r.ttft for r in results]
    out["itls"] = [r.itls for r in results]
    out["errors"] = [r.error for r in results]
    out["starts"] = [round(r.start, 4) for r in results]
    out["cached_tokens"] = [r.cached_tokens for r in results]
    turns = [r.turn for r in ok if r.turn is not None]
    if turns and max(turns) > 0:  # sessions: does a turn with a longer history start later?
        out["median_ttft_ms_by_turn"] = [percentile([r.ttft * 1000 for r in ok if r.turn == t], 50)
                                          for t in range(max(turns) + 1)]
    decisions = [r.pd_decision for r in results if r.pd_decision]
    if decisions:  # a pdserve proxy said where each prompt was prefilled
        out["pd_decisions"] = {d: decisions.count(d) for d in sorted(set(decisions))}
    return out
