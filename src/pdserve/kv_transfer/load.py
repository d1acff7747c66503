"""One consumer request's remote KV load: its progress (through `TransferState`, whose legal
transitions live in transfer_state.py), what the consumer knows about the producer's lease for it,
and the rule that params are used once.

Engine process of a decode instance. A load lives from the moment the engine accepts the request's
params (heartbeats keep the producer's lease from then on, queued or not) until its READ has ended
or the request has.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict

from pdserve.kv_transfer.messages import ReadDone, ReadFailure
from pdserve.kv_transfer.params import KVTransferParams
from pdserve.kv_transfer.transfer_state import TransferState, check_transition
from pdserve.sampling_params import InvalidRequestError


@dataclasses.dataclass
class Load:
    request_id: str
    params: KVTransferParams
    state: TransferState = TransferState.AWAITING_KV
    block_ids: list[int] = dataclasses.field(default_factory=list)  # local, from admission
    num_cached_blocks: int = 0  # ... of which the first hold the prompt's KV here (never READ into)
    deadline: float | None = None  # monotonic; no READ may be posted after it
    lease_s: float | None = None  # the producer's, from its acknowledgement
    quarantine_s: float = 0.0  # the producer's; our READ timeout stays below half of it
    last_heartbeat: float = 0.0
    reports_due: float = 0.0  # READING: the ranks must have reported by then
    results: dict[int, ReadDone | ReadFailure] = dataclasses.field(default_factory=dict)
    released: bool = False  # the producer was told to free its blocks
    pull: bool = False  # a producer pulling blocks a holder caches: a failure means computing them

    @property
    def engine_id(self) -> str:
        return self.params.remote_engine_id

    def move_to(self, state: TransferState) -> None:
        check_transition(f"load {self.request_id}", self.state, state)
        self.state = state

    @property
    def read_block_ids(self) -> list[int]:
        """The local blocks the READ writes: the producer's blocks past the cached ones."""
        return self.block_ids[self.num_cached_blocks:len(self.params.remote_block_ids)]


class Claims:
    """One producer request's KV is read by one consumer request, once: a second request with the
    same params (a retried decode leg) could otherwise read blocks the producer freed after the
    first read."""

    def __init__(self, kept: int = 1 << 16):
        self.kept = kept
        self._claimed: OrderedDict[tuple[str, str], None] = OrderedDict()

    def claim(self, params: KVTransferParams) -> None:
        key = (params.remote_engine_id, params.remote_request_id)
        if key in self._claimed:
            raise InvalidRequestError("kv_transfer_params.remote_request_id",
                                      f"{params.remote_request_id!r} of producer "
                                      f"{params.remote_engine_id!r} was already used by another request")
        self._claimed[key] = None
        if len(self._claimed) > self.kept:
            self._claimed.popitem(last=False)
