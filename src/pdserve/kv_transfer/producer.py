"""The producer role of the scheduler-side connector (engine process of a prefill instance).

After its first token, a request marked `do_remote_decode` hands its prompt's blocks to a lease and
answers with `kv_transfer_params` (docs/design.md, "Wire"), signed when the deployment has a secret
(docs/security.md). Notifications count only with a valid MAC and from the bound consumer's agent. The side-channel listener serves
handshakes, heartbeats, releases and claims (a producer of a later turn asking for the blocks this
instance caches: the engine pins them, asked by a `Pin` outcome, and they go to an unbound lease when
the next step says which it pinned). Leases that end (every expected read notified, or released)
give their blocks back through the outcome buffer; expired ones a consumer bound send them to
quarantine for twice the transfer timeout, so a READ posted just before expiry ends (or is abandoned
by its reader) before the blocks can hold anyone else's KV.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import queue
import time
import uuid
from typing import Callable

from pdserve.config import KVTransferConfig, is_loopback
from pdserve.kv_transfer.handshake import answer_handshake
from pdserve.kv_transfer.leases import LeaseState, LeaseTable
from pdserve.kv_transfer.messages import (Claim, ClaimReply, Fingerprint, HandshakeRequest, Heartbeat,
                                          HeartbeatAck, RankAgent, ReceivedNotification, Release, ReleaseAck)
from pdserve.kv_transfer.outcomes import ConnectorOutcome, Handoff, Pin, Pinned
from pdserve.kv_transfer.params import FirstToken, Holder, KVTransferParams, prompt_hash
from pdserve.kv_transfer.pull import claim_params
from pdserve.kv_transfer.signing import notification_mac_ok, sign, verify
from pdserve.sampling_params import InvalidRequestError
from pdserve.transport.deferred import Deferred

logger = logging.getLogger(__name__)

CLAIM_WAIT_S = 10.0  # at most: a claim the engine has not pinned blocks for within the claimer's wait
# (`Claim.wait_s`) gets "nothing held"
HOLDER_S = 3600.0  # how long the holder token /health offers stays valid


@dataclasses.dataclass(frozen=True)
class PendingClaim:
    """A claim waiting for the engine thread (which alone may pin blocks in its pool)."""

    claim: Claim
    reply: Deferred


class ProducerSide:
    def __init__(self, config: KVTransferConfig, engine_id: str, fingerprint: Fingerprint,
                 rank_agents: list[RankAgent], network, outcome: ConnectorOutcome,
                 clock: Callable[[], float], wake: Callable[[], None] = lambda: None,
                 caches: Callable[[bytes], bool] = lambda block_hash: True):
        self.config = config
        self._wake = wake  # the engine loop's: a claim arrived
        self._caches = caches  # a glance at the engine's prefix cache from this thread (may be stale)
        self._claims: queue.SimpleQueue[PendingClaim] = queue.SimpleQueue()  # from the side channel
        self._pinning: dict[int, PendingClaim] = {}  # asked the engine to pin blocks for these
        self._claim_ids = itertools.count()
        self.num_blocks_claimed = 0
        self._holder: Holder | None = None
        self.engine_id = engine_id
        self.fingerprint = fingerprint
        self.rank_agents = rank_agents
        self.outcome = outcome
        self.clock = clock
        self.leases = LeaseTable(config.lease_s, len(rank_agents), fingerprint.num_kv_heads)
        self.quarantine_s = 2 * config.transfer_timeout_s
        self.num_handshakes_served = 0
        self.num_bad_notifications = 0
        self.server = network.serve(config.side_channel_host, config.side_channel_port, self._handle)
        self.host = config.advertise
        logger.info("KV producer side channel on %s:%d (advertised as %s)",
                    config.side_channel_host, self.server.port, self.host)
        if config.secret is None and not is_loopback(config.side_channel_host):
            logger.warning("INSECURE: the side channel on %s has no shared secret: anyone who reaches "
                           "it can learn where this instance's KV cache is and read it "
                           "(--allow-insecure-side-channel)", config.side_channel_host)

    # --- engine thread --------------------------------------------------------------------------

    def hand_off(self, request_id: str, prompt_token_ids: list[int], block_ids: list[int],
                 first_token: FirstToken, block_hashes: tuple[str, ...], num_cached_tokens: int = 0) -> Handoff:
        """The prompt's blocks go to a lease (the first token's block, if it has its own, does not).
        `block_hashes`: the content hashes of the prompt's full blocks, signed with the rest;
        `num_cached_tokens`: the prompt tokens this instance did not compute, for the consumer to report."""
        num_blocks = -(-len(prompt_token_ids) // self.fingerprint.block_size)
        kept = list(block_ids[:num_blocks])
        params = KVTransferParams(
            do_remote_prefill=True, remote_engine_id=self.engine_id, remote_host=self.host,
            remote_port=self.server.port, remote_block_ids=tuple(kept), remote_request_id=request_id,
            producer_tp_size=len(self.rank_agents), first_token=first_token,
            prompt_hash=prompt_hash(prompt_token_ids), block_hashes=block_hashes, lease_s=self.config.lease_s,
            num_cached_tokens=num_cached_tokens,
            expires_at=round(time.time() + self.config.lease_s, 3))
        if self.config.secret is not None:
            params = dataclasses.replace(params, signature=sign(params, self.config.secret))
        self.leases.add(request_id, kept, params.lease_digest(), self.clock())
        return Handoff(kept, params.to_json())

    def holder(self) -> Holder:
        """This instance as producers may claim blocks from it, signed; re-signed once half of its
        validity has passed (wall clock: it travels between hosts through the proxy)."""
        now = time.time()
        if self._holder is None or self._holder.expires_at - now < HOLDER_S / 2:
            holder = Holder(self.engine_id, self.host, self.server.port, len(self.rank_agents),
                            expires_at=round(now + HOLDER_S, 3))
            if self.config.secret is not None:
                holder = dataclasses.replace(holder, signature=sign(holder, self.config.secret))
            self._holder = holder
        return self._holder

    def _nothing_held(self) -> ClaimReply:
        return ClaimReply("", [], len(self.rank_agents), self.config.lease_s)

    @property
    def has_claims(self) -> bool:
        return not self._claims.empty()

    def _ask_pins(self) -> None:
        """Claims that arrived since the last step: the engine alone may pin blocks in its pool."""
        while True:
            try:
                pending = self._claims.get_nowait()
            except queue.Empty:
                return
            claim_id = next(self._claim_ids)
            self._pinning[claim_id] = pending
            self.outcome.pins.append(Pin(claim_id, list(pending.claim.block_hashes), pending.claim.spare))

    def _grant(self, pending: PendingClaim, block_ids: list[int]) -> None:
        """The engine pinned `block_ids` (one reference each) for a claim: they go to an unbound
        lease, as a hand-off's do, and the claimer gets their ids. A claim whose wait ran out
        got "nothing held" instead: its lease is released at once (and freed in this step)."""
        if not block_ids:
            pending.reply.resolve(self._nothing_held())
            return
        params = claim_params(f"claim-{uuid.uuid4().hex}", block_ids)
        self.leases.add(params.remote_request_id, list(block_ids), params.lease_digest(), self.clock())
        if pending.reply.resolve(ClaimReply(params.remote_request_id, list(block_ids), len(self.rank_agents),
                                            self.config.lease_s)):
            self.num_blocks_claimed += len(block_ids)
        else:
            self.leases.release_unclaimed(params.remote_request_id, params.lease_digest())

    def release_unclaimed(self, params: KVTransferParams) -> bool:
        """Free a lease nobody has claimed (the proxy found no decode for it). Only this producer's
        own params, signed when there is a secret; a lease a consumer holds is its business."""
        if params.remote_engine_id != self.engine_id or params.remote_request_id is None:
            return False
        try:
            verify(params, self.config.secret, now=0.0,  # an expired lease may still be handed back
                   previous=self.config.previous_secret)
        except InvalidRequestError:
            return False
        return self.leases.release_unclaimed(params.remote_request_id, params.lease_digest())

    def release_undelivered(self, request_id: str) -> bool:
        """The client of this producer's request left before its answer (the params) reached it:
        free the lease now rather than at expiry, unless a consumer already bound it."""
        released = self.leases.release_undelivered(request_id)
        if released:
            logger.info("lease of %s released: its client left before the answer was delivered", request_id)
        return released

    def process_notifications(self, received: list[ReceivedNotification], num_bad: int) -> None:
        self.num_bad_notifications += num_bad
        for r in received:
            note = r.notification
            if not notification_mac_ok(note, self.config.secret, self.config.previous_secret):
                self.leases.num_ignored += 1
                logger.warning("refused a notification for %s from %s: no valid MAC",
                               note.producer_request_id, r.sender)
            elif not self.leases.notify(r.producer_rank, r.sender, note):
                logger.info("ignored notification %s from %s (consumer rank %d)",
                            note.producer_request_id, r.sender, note.consumer_rank)

    def grant(self, pinned: list[Pinned]) -> None:
        """Grant the claims the engine just pinned blocks for (its `Pin` outcomes)."""
        for p in pinned:
            self._grant(self._pinning.pop(p.claim_id), p.block_ids)

    def tick(self) -> None:
        """End the leases that are done, released or expired, and ask for pins for the claims that
        arrived since the last step."""
        now = self.clock()
        free, expired = self.leases.collect(now)
        for lease in free:
            if lease.state == LeaseState.EXPIRED:
                logger.info("lease of %s expired before any consumer spoke for it; blocks freed "
                            "(no READ can be in flight)", lease.request_id)
            self.outcome.free_blocks.extend(lease.block_ids)
        for lease in expired:
            logger.warning("lease of %s expired before every read was notified; blocks "
                           "quarantined for %.0f s", lease.request_id, self.quarantine_s)
            self.outcome.quarantine.append((now + self.quarantine_s, lease.block_ids))
        self._ask_pins()

    def next_deadline(self) -> float | None:
        return self.leases.next_deadline()

    @property
    def has_leases(self) -> bool:
        return len(self.leases) > 0

    def counters(self) -> dict:
        return {"kv_leases_expired": self.leases.num_expired,
                "kv_leases_released": self.leases.num_released,
                "kv_notifications_ignored": self.leases.num_ignored,
                "nixl_num_failed_notifications": self.num_bad_notifications,
                "kv_heartbeats_acked": self.leases.num_heartbeats,
                "kv_blocks_claimed": self.num_blocks_claimed}

    def close(self) -> None:
        self.server.close()

    # --- side-channel thread --------------------------------------------------------------------

    def _handle(self, msg):
        if isinstance(msg, HandshakeRequest):
            reply = answer_handshake(msg, self.engine_id, self.fingerprint, self.rank_agents)
            self.num_handshakes_served += not reply.error
            return reply
        if isinstance(msg, Heartbeat):
            answers = self.leases.heartbeat(msg.consumer_engine_id, msg.consumer_tp_size,
                                            msg.request_ids, msg.digests, self.clock())
            return HeartbeatAck(answers, lease_s=self.config.lease_s, quarantine_s=self.quarantine_s)
        if isinstance(msg, Claim):
            if not msg.block_hashes or not self._caches(msg.block_hashes[0]):
                return self._nothing_held()  # at once: most prompts are nobody's history (the engine re-checks)
            wait_s = min(msg.wait_s, CLAIM_WAIT_S)  # the engine pins at its next step boundary
            pending = PendingClaim(msg, Deferred(self._nothing_held(), wait_s, self.clock))
            self._claims.put(pending)
            self._wake()
            return pending.reply
        if isinstance(msg, Release):
            n = self.leases.release(msg.consumer_engine_id, msg.request_ids)
            logger.info("consumer %s released %d request(s): %s", msg.consumer_engine_id, n, msg.reason)
            if n:
                self._wake()  # the engine frees the blocks at its next step; it may be asleep
            return ReleaseAck(num_released=n)
        raise TypeError(f"unexpected side-channel message {type(msg).__name__}")

