"""What the Ray driver should do next, decided from what it knows (pure; no Ray here).

Driver process. Each instance the driver asked for is a `Member`; `info` is what its actor last
answered (or why it could not). `changes` says how many to start and which to stop, `routes` which
instances the proxy should send requests to, `status` what `pdserve ray status` shows.
"""

from __future__ import annotations

import dataclasses
from typing import Any

ROLES = ("prefill", "decode")


@dataclasses.dataclass(eq=False)  # each is itself
class Member:
    role: str
    actor: Any  # a Ray actor handle (opaque here)
    info: dict = dataclasses.field(default_factory=lambda: {"alive": False, "state": "starting"})
    pending: Any = None  # the `info` call not answered yet

    @property
    def routable(self) -> bool:
        return bool(self.info.get("alive")) and bool(self.info.get("url"))


def check_counts(prefill: int | None, decode: int | None) -> None:
    """A deployment needs a decode instance; prefill may be 0 (decode then serves requests whole)."""
    if prefill is not None and prefill < 0:
        raise ValueError(f"prefill: must be >= 0, got {prefill}")
    if decode is not None and decode < 1:
        raise ValueError(f"decode: must be >= 1, got {decode}")


def changes(wanted: dict[str, int], members: list[Member]) -> tuple[dict[str, int], list[Member]]:
    """(how many to start per role, which members to stop). Surplus goes newest first, and one that
    is not serving yet before one that is."""
    start: dict[str, int] = {}
    stop: list[Member] = []
    for role in ROLES:
        mine = [m for m in members if m.role == role]
        n = wanted.get(role, 0)
        if len(mine) < n:
            start[role] = n - len(mine)
        elif len(mine) > n:
            order = sorted(enumerate(mine), key=lambda im: (im[1].routable, -im[0]))
            stop += [m for _, m in order[:len(mine) - n]]
    return start, stop


def routes(members: list[Member]) -> dict[str, list[str]]:
    return {role: [m.info["url"] for m in members if m.role == role and m.routable] for role in ROLES}


def status(wanted: dict[str, int], members: list[Member], proxy_url: str | None) -> dict:
    instances = [{"role": m.role, **{k: v for k, v in m.info.items()}} for m in members]
    ready = {role: sum(1 for m in members if m.role == role and m.routable) for role in ROLES}
    return {"wanted": dict(wanted), "ready": ready, "proxy": proxy_url, "instances": instances}
