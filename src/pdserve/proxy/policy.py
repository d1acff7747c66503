"""How the proxy orders a pool's instances for one request (`--routing`).

Proxy process (pure). Every policy puts healthy instances first and lets equals take turns.
* `round-robin`: turns alone, load ignored.
* `least-loaded`: what this proxy has outstanding there plus the queue the instance reported, then
  its KV use.
* `kv-aware`: the work the request would add there, in prompt tokens: the ones the instance does
  not cache (from the KV index) plus `LOAD_TOKENS` for every request already outstanding or queued
  there, so a well-cached instance wins until its queue outweighs its cache (no pile-up). Without
  the prompt's tokens it is `least-loaded`.
"""

from __future__ import annotations

from typing import Callable

POLICIES = ("round-robin", "least-loaded", "kv-aware")
LOAD_TOKENS = 256  # a request queued or running on an instance weighs as this many prompt tokens


def order(policy: str, states: list, turn: int, num_tokens: int | None = None,
          cached_tokens: Callable[[object], int] | None = None) -> list:
    """`states` (UpstreamStates) best first for a prompt of `num_tokens` (None: unknown), of which
    `cached_tokens(state)` are cached on each instance."""
    n = len(states)
    rotated = [states[(turn + i) % n] for i in range(n)]
    if policy == "round-robin":
        return sorted(rotated, key=lambda s: not s.healthy)
    if policy == "kv-aware" and num_tokens is not None and cached_tokens is not None:
        return sorted(rotated, key=lambda s: (not s.healthy, work(s, num_tokens, cached_tokens(s))))
    return sorted(rotated, key=lambda s: s.score())


def work(state, num_tokens: int, cached_tokens: int) -> int:
    """Prompt tokens of work the request adds to the instance, its queue counted in."""
    return max(0, num_tokens - cached_tokens) + LOAD_TOKENS * (state.outstanding + state.queued)
