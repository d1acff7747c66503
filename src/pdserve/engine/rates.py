"""How fast this instance works, measured from its own steps: prompt tokens prefilled per second
and the duration of a step that only decodes. Routers weigh instances by these (`/health`).

Engine process, engine thread (the loop that drives the engine feeds every step). Exponentially
weighted, so a rate follows the load the instance runs under; a step that prefilled too few tokens
to time says nothing about the prefill rate.
"""

from __future__ import annotations

MIN_PREFILL_TOKENS = 16  # a step with fewer prompt tokens does not sample the prefill rate
WEIGHT = 0.2  # of each new sample


class StepRates:
    def __init__(self):
        self.prefill_tokens_per_s = 0.0  # 0: not measured yet
        self.decode_step_s = 0.0

    def observe(self, prompt_tokens: int, num_running: int, duration_s: float) -> None:
        """One step: `prompt_tokens` prefilled (cache hits and transfers not counted), with
        `num_running` requests in the batch, in `duration_s`."""
        if duration_s <= 0:
            return
        if prompt_tokens >= MIN_PREFILL_TOKENS:
            self.prefill_tokens_per_s = _mix(self.prefill_tokens_per_s, prompt_tokens / duration_s)
        elif prompt_tokens == 0 and num_running:
            self.decode_step_s = _mix(self.decode_step_s, duration_s)


def _mix(old: float, sample: float) -> float:
    return sample if old == 0 else (1 - WEIGHT) * old + WEIGHT * sample
