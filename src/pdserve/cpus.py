"""CPU sets as the command line spells them ("0-3", "0,2", "0-1,4"). Any process."""

from __future__ import annotations


def parse_cpus(spec: str | None) -> tuple[int, ...]:
    if not spec:
        return ()
    cpus: list[int] = []
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        cpus.extend(range(int(lo), int(hi or lo) + 1))
    return tuple(cpus)
