"""The producer role of the scheduler-side connector (engine process of a prefill instance).

After a prompt, a request marked `do_remote_decode` keeps its blocks under a lease and answers with
the `kv_transfer_params` of DESIGN §2. The side-channel listener serves handshakes (the agent
metadata of the ranks asked for), heartbeats and releases. Expired leases go to quarantine for
twice the transfer timeout, so a READ that was posted just before expiry finishes (or is abandoned
by its reader) before the blocks can hold anyone else's KV.
"""

from __future__ import annotations

import logging
import time

import msgspec

from pdserve.config import KVTransferConfig
from pdserve.engine.request import Request
from pdserve.kv_transfer.leases import LeaseTable
from pdserve.kv_transfer.messages import (HANDSHAKE_VERSION, Fingerprint, HandshakePayload,
                                          HandshakeReply, HandshakeRequest, Heartbeat, HeartbeatAck,
                                          RankAgent, ReceivedNotification, Release, ReleaseAck)
from pdserve.kv_transfer.params import FirstToken, KVTransferParams, prompt_hash
from pdserve.kv_transfer.side_channel import SideChannelServer

logger = logging.getLogger(__name__)


class ProducerSide:
    def __init__(self, engine, config: KVTransferConfig, rank_agents: list[RankAgent],
                 fingerprint: Fingerprint):
        self.engine = engine
        self.config = config
        self.rank_agents = rank_agents
        self.fingerprint = fingerprint
        self.tp_size = len(rank_agents)
        self.leases = LeaseTable(config.lease_s, self.tp_size, engine.spec.num_kv_heads)
        self.quarantine_s = 2 * config.transfer_timeout_s
        self._params: dict[str, dict] = {}
        self.num_handshakes_served = 0
        self.num_bad_notifications = 0
        self.server = SideChannelServer(config.side_channel_host, config.side_channel_port,
                                        config.secret, self._handle)
        self.host = config.advertise
        logger.info("KV producer side channel on %s:%d (advertised as %s)",
                    config.side_channel_host, self.server.port, self.host)

    # --- engine thread --------------------------------------------------------------------------

    def request_finished(self, request: Request) -> bool:
        """Keep the blocks of a request handed to a decode instance; others are freed as usual."""
        if not request.handoff_to_decode:
            return False
        num_blocks = self.engine.pool.blocks_needed(request.num_prompt_tokens)
        block_ids = request.block_ids[:num_blocks]
        extra = request.block_ids[num_blocks:]
        if extra:
            self.engine.pool.release(extra)
        self.leases.add(request.request_id, block_ids, time.monotonic())
        first = request.logprobs[0] if request.logprobs else None
        params = KVTransferParams(
            do_remote_prefill=True,
            remote_engine_id=self.engine.engine_id,
            remote_host=self.host,
            remote_port=self.server.port,
            remote_block_ids=tuple(block_ids),
            remote_request_id=request.request_id,
            tp_size=self.tp_size,
            first_token=FirstToken(request.output_token_ids[0],
                                   first.logprob if first else None,
                                   tuple(first.top) if first and first.top is not None else None),
            prompt_hash=prompt_hash(request.prompt_token_ids),
            lease_s=self.config.lease_s)
        self._params[request.request_id] = params.to_json()
        return True

    def take_params(self, request: Request) -> dict | None:
        return self._params.pop(request.request_id, None)

    def process_notifications(self, received: list[ReceivedNotification], num_bad: int) -> None:
        self.num_bad_notifications += num_bad
        for r in received:
            if not self.leases.notify(r.producer_rank, r.notification):
                logger.info("ignored notification %s from consumer rank %d",
                            r.notification.producer_request_id, r.notification.consumer_rank)

    def tick(self, now: float) -> None:
        free, expired = self.leases.collect(now)
        pool = self.engine.pool
        for lease in free:
            pool.release(lease.block_ids)
        for lease in expired:
            logger.warning("lease of %s expired before every read was notified; blocks "
                           "quarantined for %.0f s", lease.request_id, self.quarantine_s)
            pool.quarantine_blocks(lease.block_ids, now + self.quarantine_s)
        pool.release_quarantine(now)

    def next_deadline(self) -> float | None:
        deadlines = [d for d in (self.leases.next_deadline(),
                                 min((q[0] for q in self.engine.pool.quarantine), default=None))
                     if d is not None]
        return min(deadlines, default=None)

    @property
    def has_leases(self) -> bool:
        return len(self.leases) > 0

    def counters(self) -> dict:
        return {"kv_leases_expired": self.leases.num_expired,
                "kv_leases_released": self.leases.num_released,
                "kv_notifications_ignored": self.leases.num_ignored,
                "nixl_num_failed_notifications": self.num_bad_notifications,
                "kv_heartbeats_acked": self.leases.num_heartbeats}

    def close(self) -> None:
        self.server.close()

    # --- side-channel thread --------------------------------------------------------------------

    def _handle(self, msg):
        if isinstance(msg, HandshakeRequest):
            return self._handshake(msg)
        if isinstance(msg, Heartbeat):
            alive = self.leases.heartbeat(msg.consumer_engine_id, msg.consumer_tp_size,
                                          msg.request_ids, time.monotonic())
            return HeartbeatAck(alive=alive, lease_s=self.config.lease_s,
                                quarantine_s=self.quarantine_s)
        if isinstance(msg, Release):
            n = self.leases.release(msg.consumer_engine_id, msg.request_ids)
            logger.info("consumer %s released %d request(s): %s", msg.consumer_engine_id, n, msg.reason)
            return ReleaseAck(num_released=n)
        raise TypeError(f"unexpected side-channel message {type(msg).__name__}")

    def _handshake(self, msg: HandshakeRequest) -> HandshakeReply:
        me = self.engine.engine_id
        if msg.version != HANDSHAKE_VERSION:
            return HandshakeReply(HANDSHAKE_VERSION, me, self.fingerprint,
                                  error=f"handshake version {msg.version} is not {HANDSHAKE_VERSION}")
        if msg.engine_id != me:
            # The consumer's params name an engine that is no longer here (a restart).
            return HandshakeReply(HANDSHAKE_VERSION, me, self.fingerprint,
                                  error=f"this is engine {me}, not {msg.engine_id}")
        bad = [r for r in msg.ranks if not 0 <= r < self.tp_size]
        if bad:
            return HandshakeReply(HANDSHAKE_VERSION, me, self.fingerprint,
                                  error=f"ranks {bad} do not exist (tp_size={self.tp_size})")
        self.num_handshakes_served += 1
        payload = HandshakePayload(self.tp_size, [self.rank_agents[r] for r in msg.ranks])
        return HandshakeReply(HANDSHAKE_VERSION, me, self.fingerprint,
                              payload=msgspec.msgpack.encode(payload))
