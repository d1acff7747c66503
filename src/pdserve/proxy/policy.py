"""How the proxy orders a pool's instances for one request when caches do not decide (`--routing`).

Proxy process (pure). Every policy puts healthy instances first and lets equals take turns.
* `round-robin`: turns alone, load ignored.
* `least-loaded`: what this proxy has outstanding there plus the queue the instance reported, then
  its KV use.
* `kv-aware`: placement.py weighs what each instance caches of the prompt against its queue; a
  request whose tokens the proxy does not know is placed as `least-loaded`.
"""

from __future__ import annotations

POLICIES = ("round-robin", "least-loaded", "kv-aware")
LOAD_TOKENS = 256  # kv-aware: a request queued or running on an instance weighs as this many prompt tokens


def order(policy: str, states: list, turn: int) -> list:
    """`states` (UpstreamStates) best first, starting the turns at `turn`."""
    n = len(states)
    rotated = [states[(turn + i) % n] for i in range(n)]
    if policy == "round-robin":
        return sorted(rotated, key=lambda s: not s.healthy)
    return sorted(rotated, key=lambda s: s.score())
