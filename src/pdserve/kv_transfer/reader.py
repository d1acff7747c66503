"""The READs of one consumer rank: the producers it has loaded, each request's READ (split across
copy lanes when large) and its progress to an end.

TP rank process, the rank's transport thread only. A READ is never posted after its deadline (the
producer's lease); each producer rank read from hears DONE once its part has fully landed. A READ
that outlives its timeout is reported in doubt: it may still land, so the engine quarantines the
local blocks instead of reusing them. A producer storing another KV dtype is READ into a staging
area and converted into the cache once landed (staging.py). An evicted producer's agents are dropped once no READ uses
them.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import Callable

import msgspec
import numpy as np

from pdserve.kv_transfer.descriptors import RegionTable, build_descriptors
from pdserve.kv_transfer.lanes import CopyLane, LanePart, lane_shares
from pdserve.kv_transfer.messages import (Notification, NotificationKind, PeerAgents, ReadDone,
                                          ReadFailure, ReadSpec)
from pdserve.kv_transfer.signing import sign_notification
from pdserve.kv_transfer.staging import Staging
from pdserve.kv_transfer.topology import read_plan
from pdserve.transport.base import Agent, TransferError, XferState

logger = logging.getLogger(__name__)

_notification_encoder = msgspec.msgpack.Encoder()


@dataclasses.dataclass(frozen=True)
class PeerRank:
    agent_name: str
    regions: RegionTable


@dataclasses.dataclass(frozen=True)
class LoadedPeer:
    """A producer engine as this rank loaded it: only the ranks it reads from."""

    producer_tp_size: int
    ranks: dict[int, PeerRank]


@dataclasses.dataclass(eq=False)
class InFlight:
    spec: ReadSpec
    started: float
    handles: list = dataclasses.field(default_factory=list)  # the main agent's, one per producer rank
    lane_parts: list[LanePart] = dataclasses.field(default_factory=list)
    notes: list[tuple[str, bytes]] = dataclasses.field(default_factory=list)  # sent once all parts land
    num_bytes: int = 0
    num_descriptors: int = 0
    failed: str | None = None
    peer_gone: bool = False
    in_doubt: bool = False
    staging: Staging | None = None  # the READ lands here, in the producer's dtype, and is converted


class Reader:
    def __init__(self, agent: Agent, lanes: list[CopyLane], local: RegionTable, rank: int,
                 tp_size: int, num_kv_heads: int, clock: Callable[[], float], wake: threading.Event,
                 secret: bytes | None = None):
        self.agent = agent
        self.lanes = lanes
        self.local = local
        self.rank = rank
        self.tp_size = tp_size
        self.num_kv_heads = num_kv_heads
        self.clock = clock
        self.wake = wake  # set by lanes when a part ends
        self.secret = secret  # signs DONE notifications
        self.peers: dict[str, LoadedPeer] = {}
        self.evicting: set[str] = set()  # dropped by the engine; agents go once their READs end
        self.inflight: list[InFlight] = []
        self.in_doubt_staging: list[Staging] = []  # staging areas a timed-out READ may still write

    # --- peers ----------------------------------------------------------------------------------

    def load_peer(self, peer: PeerAgents) -> None:
        if peer.engine_id in self.peers:  # handshaken again before its eviction completed
            self.evicting.discard(peer.engine_id)
            return
        plan = read_plan(peer.producer_tp_size, self.tp_size, self.num_kv_heads)
        needed = {s.producer_rank for s in plan[self.rank]}
        ranks = {}
        for ra in peer.ranks:
            if ra.rank not in needed:
                continue  # another of our ranks reads from it
            name = self.agent.add_peer(ra.agent_metadata)
            for lane in self.lanes:
                lane.add_peer(ra.agent_metadata)
            scales = None
            if ra.scale_region_addresses:
                scales = RegionTable(tuple(ra.scale_region_addresses), ra.scale_block_bytes, ra.scale_head_bytes,
                                     ra.num_kv_heads, ra.num_blocks)
            ranks[ra.rank] = PeerRank(name, RegionTable(tuple(ra.region_addresses), ra.block_bytes,
                                                        ra.head_bytes, ra.num_kv_heads, ra.num_blocks,
                                                        ra.kv_cache_dtype, scales))
        self.peers[peer.engine_id] = LoadedPeer(peer.producer_tp_size, ranks)

    def evict(self, engine_ids: list[str]) -> None:
        self.evicting.update(e for e in engine_ids if e in self.peers)
        self._drop_evicted()

    def _drop_evicted(self) -> None:
        busy = {r.spec.engine_id for r in self.inflight}
        for engine_id in [e for e in self.evicting if e not in busy]:
            self.evicting.discard(engine_id)
            peer = self.peers.pop(engine_id, None)
            for pr in peer.ranks.values() if peer else ():
                self.agent.remove_peer(pr.agent_name)
                for lane in self.lanes:
                    lane.remove_peer(pr.agent_name)

    def loaded(self) -> list[str]:
        return sorted(f"{e}/rank{r}" for e, p in list(self.peers.items()) for r in p.ranks)

    # --- READs ----------------------------------------------------------------------------------

    def post(self, spec: ReadSpec, consumer_engine_id: str) -> ReadFailure | None:
        """Post one request's READ from every producer rank the plan names (a failure when it
        cannot start at all)."""
        now = self.clock()
        if now > spec.deadline:
            return _failure(spec, "the producer's lease would end before the READ (deadline passed)")
        peer = self.peers.get(spec.engine_id)
        if peer is None or spec.engine_id in self.evicting:
            return _failure(spec, f"producer {spec.engine_id} is not loaded on rank {self.rank}", peer_gone=True)
        plan = read_plan(peer.producer_tp_size, self.tp_size, self.num_kv_heads)[self.rank]
        missing = [s.producer_rank for s in plan if s.producer_rank not in peer.ranks]
        if missing:
            return _failure(spec, f"producer rank {missing[0]} of {spec.engine_id} is not "
                                  f"loaded on rank {self.rank}", peer_gone=True)
        staging, target, target_blocks = None, self.local, spec.local_block_ids
        theirs = peer.ranks[plan[0].producer_rank].regions
        if theirs.dtype != self.local.dtype:  # land in their dtype, convert once it has (staging.py)
            staging = Staging(self.local, theirs, len(target_blocks))
            self.agent.register(staging.address, staging.size_bytes)
            target, target_blocks = staging.regions, list(range(len(target_blocks)))
        by_rank: dict[int, list[tuple[np.ndarray, np.ndarray]]] = {}
        for s in plan:
            remote = peer.ranks[s.producer_rank].regions
            pairs = [(target, remote)]
            if target.scales is not None:  # fp8: the scales beside the blocks
                pairs.append((target.scales, remote.scales))
            by_rank.setdefault(s.producer_rank, []).extend(
                build_descriptors(l, r, s, target_blocks, spec.remote_block_ids) for l, r in pairs)
        read = InFlight(spec, now, staging=staging)
        self.inflight.append(read)
        for p_rank, parts in by_rank.items():
            local = np.concatenate([l for l, _ in parts])
            remote = np.concatenate([r for _, r in parts])
            name = peer.ranks[p_rank].agent_name
            note = _notification_encoder.encode(sign_notification(Notification(
                spec.remote_request_id, consumer_engine_id, self.rank, self.tp_size, NotificationKind.DONE),
                self.secret))
            read.num_bytes += int(local[:, 1].sum())
            read.num_descriptors += len(local)
            shares = lane_shares(local[:, 1], 1 + len(self.lanes)) if staging is None else [(0, len(local))]
            if len(shares) > 1:  # lanes copy the other shares; the producer hears once all land
                for lane, (lo, hi) in zip(self.lanes, shares[1:]):
                    read.lane_parts.append(lane.read(name, local[lo:hi], remote[lo:hi],
                                                     now + spec.timeout_s, self.wake))
                lo, hi = shares[0]
                local, remote = local[lo:hi], remote[lo:hi]
                read.notes.append((name, note))
                note = b""
            try:
                read.handles.append(self.agent.read(name, local, remote, note))
            except Exception as e:  # noqa: BLE001 - READs already posted stay tracked until they end
                read.failed, read.peer_gone = str(e), isinstance(e, TransferError)
                break
        return None

    def progress(self) -> list[ReadDone | ReadFailure]:
        """READs that ended since the last call."""
        now = self.clock()
        ended, still = [], []
        for read in self.inflight:
            states = [self.agent.state(h) for h in read.handles]
            if XferState.ERR in states and read.failed is None:
                read.failed, read.peer_gone = "the producer went away or the READ failed", True
            for part in read.lane_parts:
                if part.done.is_set() and part.error:
                    read.in_doubt |= part.in_doubt
                    if read.failed is None:
                        read.failed, read.peer_gone = part.error, part.peer_gone
            busy = XferState.PROC in states or not all(p.done.is_set() for p in read.lane_parts)
            timed_out = now - read.started > read.spec.timeout_s
            if busy and not timed_out:
                still.append(read)
                continue
            for h in read.handles:
                self.agent.release(h)
            result = self._end(read, now, abandoned=busy)
            if read.staging is not None:
                self._unstage(read, result)
            ended.append(result)
        self.inflight = still
        if self.evicting:
            self._drop_evicted()
        return ended

    def _end(self, read: InFlight, now: float, abandoned: bool) -> ReadDone | ReadFailure:
        if abandoned:
            return _failure(read.spec, f"READ timed out after {read.spec.timeout_s:g} s",
                            peer_gone=True, in_doubt=True)
        if read.failed:
            return _failure(read.spec, read.failed, peer_gone=read.peer_gone, in_doubt=read.in_doubt)
        try:  # a READ split across lanes: tell the producer ranks now that every part has landed
            for name, note in read.notes:
                self.agent.notify(name, note)
        except Exception as e:  # noqa: BLE001 - reported as a failed READ
            logger.warning("rank %d: DONE notification for %s failed: %s", self.rank, read.spec.request_id, e)
            return _failure(read.spec, "the READ landed but the producer could not be told",
                            peer_gone=True, in_doubt=True)
        return ReadDone(read.spec.request_id, read.num_bytes, read.num_descriptors, now - read.started)


    def _unstage(self, read: InFlight, result: ReadDone | ReadFailure) -> None:
        """Convert a landed READ into the cache; free its staging area unless a READ may still land
        in it (then it is kept, as the engine quarantines the blocks of such a READ)."""
        if isinstance(result, ReadFailure) and result.in_doubt:
            self.in_doubt_staging.append(read.staging)
            return
        if isinstance(result, ReadDone):
            read.staging.convert_into_cache(read.spec.local_block_ids)
        self.agent.deregister(read.staging.address)


def _failure(spec: ReadSpec, reason: str, peer_gone: bool = False, in_doubt: bool = False) -> ReadFailure:
    return ReadFailure(spec.request_id, spec.engine_id, reason, peer_gone, in_doubt)
