"""The engine <-> connector seam, once per step: what the engine tells the connector (`StepIn`) and
what the connector decides for the engine to apply (`ConnectorOutcome`): decide, then apply.

Engine process. The connector never touches the engine, its scheduler or its block pool: it returns
these records and the engine applies them, in this order: blocks to free, blocks to quarantine,
then each load outcome (quarantining the request's own blocks first when they are in doubt), then
the pins claims ask for (their block ids go back in the next `StepIn`).
"""

from __future__ import annotations

import dataclasses

from pdserve.kv_transfer.messages import ConnectorReport
from pdserve.kv_transfer.params import Holder
from pdserve.kv_transfer.transfer_state import TransferState


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
class Pin:
    """A producer of another instance claims blocks this one caches: take one reference on each
    block of the leading run of `block_hashes` this instance holds, and hand them straight back to
    the connector as `Pinned` (none held: an empty list). `spare`: the claimer keeps them now, so
    this instance's copy becomes a spare one (BlockPool.pin)."""

    claim_id: int
    block_hashes: list[bytes]
    spare: bool = False


@dataclasses.dataclass(frozen=True)
class Pinned:
    claim_id: int
    block_ids: list[int]  # each with one reference taken for the claim (a lease owns it now)


@dataclasses.dataclass(frozen=True)
class StepIn:
    """What the engine tells the connector once per step, after the ranks ran: what its scheduler
    admitted this step and each rank's report (empty when the ranks did not run)."""

    loads: list[RemoteLoad] = ()
    pulls: list[RemotePull] = ()
    reports: list[ConnectorReport | None] = ()  # in rank order


@dataclasses.dataclass(frozen=True)
class LoadOutcome:
    request_id: str
    state: TransferState  # how the load ended (`is_final`): KV_LOADED, RECOMPUTING, FAILED, ABORTED
    message: str = ""  # FAILED: what the client is told
    # A READ may still land in these local blocks (the ones it wrote into, never a shared cached
    # block): keep them out of reuse until then.
    quarantine_until: float | None = None
    quarantine_blocks: tuple[int, ...] = ()
    num_blocks: int = 0  # KV_LOADED: how many blocks were READ (a pull may get fewer than it asked)

    def __post_init__(self):
        assert self.state.is_final, f"{self.request_id}: a load does not end in {self.state}"


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
    pins: list[Pin] = dataclasses.field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.loads or self.free_blocks or self.quarantine or self.pins)

    def take(self) -> "ConnectorOutcome":
        """Everything collected so far; this buffer starts empty again."""
        out = ConnectorOutcome(self.loads, self.free_blocks, self.quarantine, self.pins)
        self.loads, self.free_blocks, self.quarantine, self.pins = [], [], [], []
        return out
