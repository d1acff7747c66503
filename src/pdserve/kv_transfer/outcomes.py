"""What the scheduler-side connector decides, for the engine to apply (decide, then apply).

Engine process. The connector never touches the engine, its scheduler or its block pool: it returns
these records and the engine applies them, in this order: blocks to free, blocks to quarantine,
then each load outcome (quarantining the request's own blocks first when they are in doubt).
"""

from __future__ import annotations

import dataclasses
import enum

from pdserve.kv_transfer.params import Holder


class LoadResult(enum.Enum):
    LOADED = "loaded"  # the KV arrived: the request runs from its first generated token
    FAILED = "failed"  # the request ends with `message` (policy `fail`)
    RECOMPUTE = "recompute"  # prefill locally instead (policy `recompute`)
    ABORTED = "aborted"  # the client left while READs were in flight; they have ended now


@dataclasses.dataclass(frozen=True)
class RemoteLoad:
    """A consumer request the scheduler just admitted: its local blocks (the prompt's, then one for
    the first token), of which the first `num_cached_blocks` already hold the prompt's KV here (its
    prefix cache, the hashes agreeing with the producer's): only the rest is READ."""

    request_id: str
    block_ids: list[int]
    num_cached_blocks: int = 0


@dataclasses.dataclass(frozen=True)
class RemotePull:
    """A producer request the scheduler admitted to pull the prompt's blocks it does not cache from
    instances that may (`holders`): the local blocks to fill and those blocks' content hashes."""

    request_id: str
    block_ids: list[int]
    block_hashes: list[bytes]
    holders: tuple[Holder, ...]


@dataclasses.dataclass(frozen=True)
class LoadOutcome:
    request_id: str
    result: LoadResult
    message: str = ""
    # A READ may still land in these local blocks (the ones it wrote into, never a shared cached
    # block): keep them out of reuse until then.
    quarantine_until: float | None = None
    quarantine_blocks: tuple[int, ...] = ()
    num_blocks: int = 0  # LOADED: how many blocks were READ (a pull may get fewer than it asked)


@dataclasses.dataclass(frozen=True)
class Handoff:
    """A producer request's blocks now belong to a lease; the engine must not free them."""

    block_ids: list[int]
    params: dict  # the `kv_transfer_params` of the producer's answer


@dataclasses.dataclass
class ConnectorOutcome:
    loads: list[LoadOutcome] = dataclasses.field(default_factory=list)
    free_blocks: list[int] = dataclasses.field(default_factory=list)  # leases that ended: free now
    quarantine: list[tuple[float, list[int]]] = dataclasses.field(default_factory=list)  # (until, blocks)

    def __bool__(self) -> bool:
        return bool(self.loads or self.free_blocks or self.quarantine)

    def take(self) -> "ConnectorOutcome":
        """Everything collected so far; this buffer starts empty again."""
        out = ConnectorOutcome(self.loads, self.free_blocks, self.quarantine)
        self.loads, self.free_blocks, self.quarantine = [], [], []
        return out
