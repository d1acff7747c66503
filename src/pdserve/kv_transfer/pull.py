"""Pulling a prompt's blocks from an instance that caches them (a decode instance that served the
conversation's earlier turns), for a producer that would otherwise compute them, or for a decode
instance prefilling the prompt itself.

Engine process of the instance prefilling (engine thread; claim replies come back on the side channel's
thread as `ClaimReplied` events). The proxy names the holders it knows, each signed by itself
(`kv_holders`); the scheduler admits a request whose uncached full blocks are worth pulling
(`RemotePull`), and the puller asks its holders in turn with a `Claim` of those blocks' content
hashes. The first holder that leases some of them turns the pull into an ordinary `Load` of those
blocks (handshake, the heartbeat that binds the lease, READ, notifications). A pull that gets
nothing, or fails anywhere later, ends in RECOMPUTE: the producer computes the blocks itself, and
its client never sees a pull fail.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable

from pdserve.config import KVTransferConfig
from pdserve.kv_transfer.load import Load
from pdserve.kv_transfer.messages import Claim, ClaimReply, Release
from pdserve.kv_transfer.outcomes import RemotePull
from pdserve.kv_transfer.params import Holder, KVTransferParams

logger = logging.getLogger(__name__)

CLAIM_TIMEOUT_S = 10.0  # a holder that has not answered by then is skipped (or by the handshake timeout)
REPLY_MARGIN_S = 1.0  # the holder says "nothing held" this long before the claimer would give up


@dataclasses.dataclass(frozen=True)
class ClaimReplied:
    """Side-channel thread -> engine thread: a holder's answer to a claim (or the exception)."""

    request_id: str
    holder: Holder
    reply: object


@dataclasses.dataclass
class _Pulling:
    spec: RemotePull
    next_holder: int = 0


class Puller:
    def __init__(self, config: KVTransferConfig, engine_id: str, client,
                 deliver: Callable[[ClaimReplied], None]):
        self.config = config
        self.engine_id = engine_id
        self.client = client
        self.deliver = deliver  # called on the side channel's thread
        self.pending: dict[str, _Pulling] = {}

    def start(self, spec: RemotePull) -> None:
        pulling = _Pulling(spec)
        self.pending[spec.request_id] = pulling
        self._ask(pulling)

    def abort(self, request_id: str) -> bool:
        """Forget a pull still claiming (a lease granted later is released on arrival)."""
        return self.pending.pop(request_id, None) is not None

    def replied(self, event: ClaimReplied) -> Load | None | bool:
        """A Load of the blocks a holder leased; None while other holders are still asked; False
        when nobody holds any (or the request has ended)."""
        reply, holder = event.reply, event.holder
        pulling = self.pending.get(event.request_id)
        granted = isinstance(reply, ClaimReply) and reply.lease_id and reply.block_ids
        if pulling is None:
            if granted:
                self._release(holder, reply.lease_id, "the request ended while claiming")
            return None
        num_wanted = len(pulling.spec.block_ids)
        if granted and len(reply.block_ids) <= num_wanted:
            del self.pending[event.request_id]
            params = dataclasses.replace(
                claim_params(reply.lease_id, reply.block_ids), remote_engine_id=holder.engine_id,
                remote_host=holder.host, remote_port=holder.port, producer_tp_size=reply.holder_tp_size)
            return Load(event.request_id, params, block_ids=pulling.spec.block_ids[:len(reply.block_ids)],
                        pull=True)
        if granted:  # more blocks than were asked for: not a reply to our claim
            self._release(holder, reply.lease_id, "the grant does not match the claim")
        elif not isinstance(reply, ClaimReply):
            logger.info("%s: holder %s did not answer a claim: %s", event.request_id, holder.engine_id, reply)
        if pulling.next_holder < len(pulling.spec.holders):
            self._ask(pulling)
            return None
        del self.pending[event.request_id]
        return False

    def _ask(self, pulling: _Pulling) -> None:
        holder = pulling.spec.holders[pulling.next_holder]
        pulling.next_holder += 1
        rid = pulling.spec.request_id
        timeout_s = min(CLAIM_TIMEOUT_S, self.config.handshake_timeout_s)
        claim = Claim(self.engine_id, list(pulling.spec.block_hashes), spare=holder.spare,
                      wait_s=max(0.0, timeout_s - REPLY_MARGIN_S))
        self.client.send(holder.host, holder.port, claim, timeout_s,
                         lambda reply: self.deliver(ClaimReplied(rid, holder, reply)))

    def _release(self, holder: Holder, lease_id: str, reason: str) -> None:
        self.client.send(holder.host, holder.port, Release(self.engine_id, [lease_id], reason),
                         self.config.handshake_timeout_s, lambda reply: None)


def claim_params(lease_id: str, block_ids: list[int]) -> KVTransferParams:
    """What both sides of a claim know of its lease: the claimer reads with these, and the holder's
    lease answers only to their digest."""
    return KVTransferParams(remote_request_id=lease_id, remote_block_ids=tuple(block_ids))
