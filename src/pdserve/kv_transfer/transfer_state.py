"""A request's part in P/D: one enum, its legal transitions in one table.

Engine process. Two owners move it, each through the states it sees (docs/design.md, "Block
lifecycle"): the engine's `Request` (NONE; PRODUCING -> HANDED_OFF; AWAITING_KV -> KV_LOADED or
RECOMPUTING, the end of a load applied from the connector's outcome) and the connector's `Load`
(load.py), which walks the states in between and ends in the state the outcome carries.
"""

from __future__ import annotations

import enum

from pdserve.kv_transfer.params import KVTransferParams


class TransferState(enum.Enum):
    NONE = "none"  # served here from start to end
    PRODUCING = "producing"  # prefill for a remote decode: hand off after the first token
    HANDED_OFF = "handed_off"  # finished here; its prompt's blocks belong to a lease
    AWAITING_KV = "awaiting_kv"  # decode: the prompt's KV comes from the producer; queued for blocks
    WAITING_PEER = "waiting_peer"  # local blocks allocated; handshake or first acknowledgement outstanding
    READY = "ready"  # the next step posts the READ
    READING = "reading"  # waiting for every rank's report
    ABORTING = "aborting"  # the client left while reading: end once every rank has reported
    KV_LOADED = "kv_loaded"  # the KV arrived: the request runs from its first generated token
    RECOMPUTING = "recomputing"  # could not be loaded: the prompt is prefilled here (policy `recompute`)
    FAILED = "failed"  # could not be loaded: the request ends with the outcome's message (policy `fail`)
    ABORTED = "aborted"  # the client left while READs were in flight; they have ended now

    @classmethod
    def initial(cls, params: KVTransferParams | None) -> "TransferState":
        if params is not None and params.do_remote_decode:
            return cls.PRODUCING
        if params is not None and params.do_remote_prefill:
            return cls.AWAITING_KV
        return cls.NONE

    @property
    def is_final(self) -> bool:
        """How a load ends: the state a `LoadOutcome` carries."""
        return self in _FINAL


_FINAL = {TransferState.KV_LOADED, TransferState.RECOMPUTING, TransferState.FAILED, TransferState.ABORTED}
_GIVE_UP = {TransferState.FAILED, TransferState.RECOMPUTING}  # a load that cannot go on, by policy
TRANSITIONS = {
    TransferState.PRODUCING: {TransferState.HANDED_OFF},
    TransferState.AWAITING_KV: {TransferState.WAITING_PEER, TransferState.KV_LOADED} | _GIVE_UP,  # loaded:
    # every block of the prompt was cached here (or, on the engine's request, any load that arrived)
    TransferState.WAITING_PEER: {TransferState.READY} | _GIVE_UP,
    TransferState.READY: {TransferState.READING} | _GIVE_UP,
    TransferState.READING: {TransferState.ABORTING, TransferState.KV_LOADED} | _GIVE_UP,
    TransferState.ABORTING: {TransferState.ABORTED},
}
NOT_READING = (TransferState.AWAITING_KV, TransferState.WAITING_PEER, TransferState.READY)  # can end at once
IN_FLIGHT = (TransferState.READING, TransferState.ABORTING)  # a READ into the local blocks may be live


def check_transition(owner: str, old: TransferState, new: TransferState) -> None:
    if new not in TRANSITIONS.get(old, ()):
        raise AssertionError(f"{owner}: illegal {old} -> {new}")
