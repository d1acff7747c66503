"""The consumer role of the scheduler-side connector (engine process of a decode instance).

Per request (docs/design.md, "Block lifecycle"): accepted params start a `Load`; heartbeats keep the
producer's lease from that moment, queued or not; admission brings local blocks; the READ is posted
only before the conservative deadline the last acknowledged heartbeat gives; once every rank has
reported, the load is LOADED (or ABORTED), and when they have not within the READ timeout the
local blocks are in doubt (a READ may still land) and go to quarantine. Whoever gives up tells the
producer to release. Every decision is a `LoadOutcome` in the shared outcome buffer; nothing here
touches the engine.
"""

from __future__ import annotations

import logging
import queue
import time
from collections import deque
from typing import Callable

from pdserve.config import KVTransferConfig
from pdserve.kv_transfer.handshake import HandshakeReplied, PeerState, PeerTable, tp_mismatch
from pdserve.kv_transfer.lease_keeper import HeartbeatReplied, LeaseKeeper
from pdserve.kv_transfer.load import Claims, Load
from pdserve.kv_transfer.messages import (ConnectorReport, Fingerprint, HeartbeatAck, LeaseAnswer, PeerAgents,
                                          ReadFailure, ReadSpec)
from pdserve.kv_transfer.outcomes import ConnectorOutcome, LoadOutcome, RemoteLoad, RemotePull
from pdserve.kv_transfer.params import Holder, KVTransferParams
from pdserve.kv_transfer.pull import ClaimReplied, Puller
from pdserve.kv_transfer.signing import verify
from pdserve.kv_transfer.transfer_state import IN_FLIGHT, NOT_READING, TransferState
from pdserve.sampling_params import InvalidRequestError

logger = logging.getLogger(__name__)

REPORT_GRACE_S = 5.0  # after the READ timeout, how long the ranks get to report before we stop waiting
TRANSFERS_KEPT = 1024  # per-transfer records kept between two scrapes of /metrics
_LEASE_LOST = {
    LeaseAnswer.GONE: "producer {0} no longer holds the KV of {1} (lease expired or released)",
    LeaseAnswer.MISMATCH: "producer {0} holds {1} for other params: kv_transfer_params were changed",
    LeaseAnswer.TAKEN: "producer {0} holds {1} for another consumer",
}


class ConsumerSide:
    def __init__(self, config: KVTransferConfig, engine_id: str, fingerprint: Fingerprint,
                 tp_size: int, num_kv_heads: int, client, outcome: ConnectorOutcome,
                 clock: Callable[[], float], wake: Callable[[], None]):
        self.config = config
        self.engine_id = engine_id
        self.tp_size = tp_size
        self.client = client
        self.outcome = outcome
        self.clock = clock
        self._wake = wake  # ends the engine loop's sleep (called on the side channel's thread)
        self._events: queue.SimpleQueue[HandshakeReplied | HeartbeatReplied | ClaimReplied] = queue.SimpleQueue()
        self.peers = PeerTable(client, fingerprint, tp_size, num_kv_heads, config.handshake_timeout_s,
                               self._event, clock)
        self.loads: dict[str, Load] = {}
        self.claims = Claims()
        self.leases = LeaseKeeper(config, engine_id, tp_size, client, clock, self._event)
        self.puller = Puller(config, engine_id, client, self._event)
        self.counters = {"nixl_num_failed_transfers": 0, "kv_transfers": 0, "kv_blocks_read": 0,
                         "kv_blocks_read_skipped": 0, "kv_blocks_pulled": 0}
        self.transfers: deque[dict] = deque(maxlen=TRANSFERS_KEPT)

    # --- requests (engine thread) -------------------------------------------------------------

    def add(self, request_id: str, params: KVTransferParams) -> None:
        """The engine accepts a request with these params: refuse (InvalidRequestError) or start
        keeping the producer's lease alive."""
        verify(params, self.config.secret, time.time(), previous=self.config.previous_secret,
               skew_s=self.config.clock_skew_s)  # before anything is dialed
        if self.config.producers and f"{params.remote_host}:{params.remote_port}" not in self.config.producers:
            raise InvalidRequestError("kv_transfer_params.remote_host",
                                      f"{params.remote_host}:{params.remote_port} is not one of this "
                                      "instance's producers (--kv-producers)")
        error = self.peers.check_tp(params.remote_engine_id, params.producer_tp_size)
        if error:
            raise InvalidRequestError("kv_transfer_params.tp_size", error)
        self.claims.claim(params)
        load = Load(request_id, params)
        self.loads[request_id] = load
        peer = self.peers.get(params.remote_engine_id) or self.peers.handshake(
            params.remote_engine_id, params.remote_host, params.remote_port, params.producer_tp_size)
        self.leases.heartbeat(peer.engine_id, peer.host, peer.port, [load])

    def check_holders(self, holders: tuple[Holder, ...]) -> None:
        """A producer request names instances to claim blocks from: each must be signed by one of
        this deployment's instances (and be among --kv-producers when those are listed)."""
        for i, holder in enumerate(holders):
            field = f"kv_transfer_params.kv_holders[{i}]"
            verify(holder, self.config.secret, time.time(), previous=self.config.previous_secret,
                   skew_s=self.config.clock_skew_s, field=field)
            if self.config.producers and f"{holder.host}:{holder.port}" not in self.config.producers:
                raise InvalidRequestError(f"{field}.host", f"{holder.host}:{holder.port} is not one of this "
                                                           "instance's peers (--kv-producers)")

    def admit(self, admitted: RemoteLoad) -> None:
        """The request got its local blocks (prompt + first token), the first `num_cached_blocks`
        of them already holding the prompt's KV here. When they hold all of it nothing is READ:
        the request runs at once and the producer frees its blocks now."""
        load = self.loads[admitted.request_id]
        load.block_ids = list(admitted.block_ids)
        load.num_cached_blocks = admitted.num_cached_blocks
        self.counters["kv_blocks_read_skipped"] += load.num_cached_blocks
        if load.num_cached_blocks == len(load.params.remote_block_ids):
            self._drop(load, "every block of the prompt is cached here")
            return self._end(load, TransferState.KV_LOADED)
        load.move_to(TransferState.WAITING_PEER)
        self._promote(load)

    def pull(self, spec: RemotePull) -> None:
        """A producer request waits for blocks its holders may have (pull.py)."""
        self.puller.start(spec)

    def abort(self, request_id: str) -> bool:
        """True when the engine must wait for an ABORTED outcome (a READ into the request's blocks
        may be in flight)."""
        if self.puller.abort(request_id):
            return False
        load = self.loads.get(request_id)
        if load is None:
            return False
        if load.state in IN_FLIGHT:
            if load.state == TransferState.READING:
                load.move_to(TransferState.ABORTING)
            return True
        self._drop(load, "client aborted")
        return False

    def finished(self, request_id: str) -> None:
        """The engine ended the request; a load that never started reading tells the producer."""
        self.puller.abort(request_id)
        load = self.loads.get(request_id)
        if load is not None and load.state in NOT_READING:
            self._drop(load, "request ended before reading")

    # --- every engine step ----------------------------------------------------------------------

    def tick(self) -> None:
        """Apply side-channel replies, end stalled READs, send heartbeats that are due."""
        while True:
            try:
                event = self._events.get_nowait()
            except queue.Empty:
                break
            if isinstance(event, HandshakeReplied):
                self._on_handshake(event)
            elif isinstance(event, ClaimReplied):
                self._on_claim(event)
            else:
                self._on_heartbeat(event)
        now = self.clock()
        due: dict[str, list[Load]] = {}
        for load in list(self.loads.values()):
            if load.state in IN_FLIGHT and now > load.reports_due:
                self._finish(load, stalled=True)
            elif load.state != TransferState.ABORTING and self.leases.due(load, now):
                due.setdefault(load.engine_id, []).append(load)
        for engine_id, loads in due.items():
            peer = self.peers.get(engine_id)
            if peer is not None:
                self.leases.heartbeat(engine_id, peer.host, peer.port, loads)

    def build(self) -> tuple[list[PeerAgents], list[str], list[ReadSpec]]:
        """Peers the ranks must load or drop, and the READs to post now."""
        reads = []
        now = self.clock()
        for load in [l for l in self.loads.values() if l.state == TransferState.READY]:
            p = load.params
            timeout = min(self.config.transfer_timeout_s, load.quarantine_s / 2)
            load.move_to(TransferState.READING)
            load.reports_due = now + timeout + REPORT_GRACE_S
            skip = load.num_cached_blocks
            reads.append(ReadSpec(load.request_id, p.remote_engine_id, p.remote_request_id,
                                  list(p.remote_block_ids[skip:]), load.read_block_ids,
                                  load.deadline, timeout))
        return self.peers.to_workers(), self.peers.take_evicted(), reads

    def process(self, reports: list[ConnectorReport]) -> None:
        for rank, report in enumerate(reports):
            for item in [*report.done, *report.failed]:
                load = self.loads.get(item.request_id)
                if load is not None and load.state in IN_FLIGHT:
                    load.results[rank] = item
        for load in [l for l in self.loads.values() if len(l.results) == self.tp_size]:
            self._finish(load)

    # --- side-channel replies ---------------------------------------------------------------------

    def _event(self, event: HandshakeReplied | HeartbeatReplied) -> None:
        self._events.put(event)
        self._wake()

    def _on_handshake(self, event: HandshakeReplied) -> None:
        result = self.peers.accept(event)
        if result is None:
            return
        if result.error:
            return self._fail_waiting(result.engine_id, result.error)
        waiting = [l for l in self.loads.values()
                   if l.engine_id == result.engine_id and l.state in NOT_READING]
        for load in [l for l in waiting if l.params.producer_tp_size != result.producer_tp_size]:
            self._fail(load, tp_mismatch(result.engine_id, load.params.producer_tp_size,
                                         result.producer_tp_size))
        right = [l for l in waiting if l.params.producer_tp_size == result.producer_tp_size]
        if not result.ready:  # asked with another request's wrong TP size: ask again for these
            if right:
                p = right[0].params
                self.peers.handshake(result.engine_id, p.remote_host, p.remote_port, result.producer_tp_size)
            return
        for gone in result.replaced:
            self._fail_waiting(gone, f"producer {gone} was replaced by {result.engine_id} at its address")
        for load in right:
            self._promote(load)

    def _on_claim(self, event: ClaimReplied) -> None:
        load = self.puller.replied(event)
        if load is False:
            self.outcome.loads.append(LoadOutcome(event.request_id, TransferState.RECOMPUTING,
                                                  "no holder caches the prompt's blocks"))
        elif load is not None:  # a holder leased some: read them as a consumer reads a hand-off
            self.loads[load.request_id] = load
            load.move_to(TransferState.WAITING_PEER)
            p = load.params
            peer = self.peers.get(p.remote_engine_id) or self.peers.handshake(
                p.remote_engine_id, p.remote_host, p.remote_port, p.producer_tp_size)
            self.leases.heartbeat(peer.engine_id, peer.host, peer.port, [load])

    def _on_heartbeat(self, event: HeartbeatReplied) -> None:
        reply = event.reply
        if not isinstance(reply, HeartbeatAck) or len(reply.answers) != len(event.request_ids):
            if any(l.engine_id == event.engine_id and l.state in NOT_READING for l in self.loads.values()):
                self._fail_waiting(event.engine_id, f"producer {event.engine_id} unreachable "
                                                    f"(heartbeat: {reply})")
            return
        for rid, answer in zip(event.request_ids, reply.answers):
            load = self.loads.get(rid)
            if load is None or load.engine_id != event.engine_id:
                continue
            if answer != LeaseAnswer.HELD:
                if load.state in NOT_READING:
                    self._fail(load, _LEASE_LOST[answer].format(event.engine_id, load.params.remote_request_id))
                continue
            load.deadline = event.sent_at + reply.lease_s - max(0.1 * reply.lease_s, 0.05)
            load.lease_s, load.quarantine_s = reply.lease_s, reply.quarantine_s
            self._promote(load)

    # --- decisions ------------------------------------------------------------------------------

    def _promote(self, load: Load) -> None:
        """WAITING_PEER -> READY once the producer is verified and has acknowledged the lease."""
        peer = self.peers.get(load.engine_id)
        if load.state != TransferState.WAITING_PEER or load.deadline is None \
                or peer is None or peer.state != PeerState.READY:
            return
        pool_size = min((r.num_blocks for r in peer.agents.ranks), default=0)
        too_big = [b for b in load.params.remote_block_ids if b >= pool_size]
        if too_big:
            return self._fail(load, f"kv_transfer_params.remote_block_ids {too_big[:4]} are beyond "
                                    f"the producer's pool ({pool_size} blocks)")
        load.move_to(TransferState.READY)

    def _finish(self, load: Load, stalled: bool = False) -> None:
        """Every rank reported (or, `stalled`, some never did within the READ timeout)."""
        del self.loads[load.request_id]
        failures = [r for r in load.results.values() if isinstance(r, ReadFailure)]
        aborted = load.state == TransferState.ABORTING
        if not failures and not stalled:
            done = list(load.results.values())
            self.counters["kv_transfers"] += 1
            self.counters["kv_blocks_pulled" if load.pull else "kv_blocks_read"] += len(load.read_block_ids)
            self.transfers.append({"num_bytes": sum(d.num_bytes for d in done),
                                   "num_descriptors": sum(d.num_descriptors for d in done),
                                   "duration_s": max(d.duration_s for d in done)})
            state = TransferState.ABORTED if aborted else TransferState.KV_LOADED
            return self._end(load, state, num_blocks=len(load.read_block_ids))
        self.counters["nixl_num_failed_transfers"] += 1
        reasons = "; ".join(sorted({f.reason for f in failures}) or ["some ranks never reported their READ"])
        if stalled or any(f.peer_gone for f in failures):
            self._fail_waiting(load.engine_id, reasons)
        until = None
        if stalled or any(f.in_doubt for f in failures):
            until = self.clock() + 2 * self.config.transfer_timeout_s
        self.leases.release(load, "client aborted" if aborted else reasons)
        if aborted:
            self._end(load, TransferState.ABORTED, quarantine_until=until,
                      quarantine_blocks=tuple(load.read_block_ids))
        else:
            self._decide(load, f"KV transfer from producer {load.engine_id} failed: {reasons}", until)

    def _fail(self, load: Load, message: str) -> None:
        """A load that is not reading cannot go on."""
        self.loads.pop(load.request_id, None)
        self.leases.release(load, message)
        self._decide(load, message, None)

    def _decide(self, load: Load, message: str, quarantine_until: float | None) -> None:
        """Policy `fail`: the client gets `message`; `recompute`: prefill here instead (always, for
        a pull: the producer computes what it could not read)."""
        recompute = self.config.failure_policy == "recompute" or load.pull
        logger.warning("%s: %s%s", load.request_id, message, "; recomputing the prompt locally" * recompute)
        in_doubt = tuple(load.read_block_ids) if quarantine_until is not None else ()
        self._end(load, TransferState.RECOMPUTING if recompute else TransferState.FAILED, message,
                  quarantine_until, in_doubt)

    def _end(self, load: Load, state: TransferState, message: str = "", quarantine_until: float | None = None,
             quarantine_blocks: tuple[int, ...] = (), num_blocks: int = 0) -> None:
        """The load is over (it has left `loads`): its final state goes to the engine."""
        load.move_to(state)
        self.outcome.loads.append(LoadOutcome(load.request_id, state, message, quarantine_until,
                                              quarantine_blocks, num_blocks))

    def _fail_waiting(self, engine_id: str, reason: str) -> None:
        """Forget a producer (the next request naming it handshakes again). Its loads that are not
        reading cannot progress; the ranks drop its agents once their READs from it have ended."""
        self.peers.evict(engine_id)
        for load in [l for l in self.loads.values() if l.engine_id == engine_id and l.state in NOT_READING]:
            self._fail(load, reason)

    def _drop(self, load: Load, reason: str) -> None:
        del self.loads[load.request_id]
        self.leases.release(load, reason)

    # --- timers -----------------------------------------------------------------------------------

    @property
    def has_events(self) -> bool:
        """Side-channel replies wait for the engine thread."""
        return not self._events.empty()

    def next_timer(self) -> float | None:
        """When a heartbeat is due, or the ranks' reports of a READ are (the READ then stalled);
        a READ that ends is reported by its ranks without a timer."""
        due = [l.reports_due for l in self.loads.values() if l.state in IN_FLIGHT]
        heartbeat = self.leases.next_heartbeat([l for l in self.loads.values()  # those `tick` sends
                                                 if l.state != TransferState.ABORTING and self.peers.get(l.engine_id)])
        return min([*due, *([heartbeat] if heartbeat is not None else [])], default=None)

    def counter_values(self) -> dict:
        return {**self.counters, "kv_heartbeats": self.leases.num_heartbeats,
                "nixl_handshakes": len(self.peers.engine_ids_seen),
                "nixl_handshake_round_trips": self.peers.round_trips,
                "nixl_handshake_failures": self.peers.failures}
