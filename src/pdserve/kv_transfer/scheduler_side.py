"""The scheduler side of the KV connector: the one object the engine talks to.

Engine process. Composes the two roles (an instance can produce for one request and consume for
another). Per request the engine hands it plain values (request ids, params, block ids); once per
step, after the ranks ran, one `step` call takes a `StepIn` (what was admitted, what the ranks
reported, what the engine pinned) and returns one `ConnectorOutcome` for the engine to apply to its
scheduler and block pool, and the `ConnectorMetadata` the ranks get with the next step (outcomes.py;
docs/design.md, "The connector seam"). Nothing here holds a handle to the engine. `NoConnector` is
the same interface for an instance started without P/D.
"""

from __future__ import annotations

import time
from typing import Callable

from pdserve.config import KVTransferConfig
from pdserve.kv_transfer.consumer import ConsumerSide
from pdserve.kv_transfer.messages import ConnectorMetadata, ConnectorReport, Fingerprint, RankAgent
from pdserve.kv_transfer.outcomes import ConnectorOutcome, Handoff, Pinned, StepIn
from pdserve.kv_transfer.params import FirstToken, KVTransferParams
from pdserve.kv_transfer.producer import ProducerSide
from pdserve.sampling_params import InvalidRequestError


class SchedulerConnector:
    def __init__(self, config: KVTransferConfig, engine_id: str, fingerprint: Fingerprint,
                 rank_agents: list[RankAgent], network=None,
                 clock: Callable[[], float] = time.monotonic, wake: Callable[[], None] = lambda: None,
                 caches: Callable[[bytes], bool] = lambda block_hash: True):
        """`network` makes the side channel's server and client (default: ZMQ); `wake` ends the
        engine loop's sleep when a side-channel reply arrives (called on another thread); `caches`
        says whether the engine's prefix cache holds a block hash now (read from another thread: a
        claim for a prompt nobody cached is answered without waiting for the engine)."""
        if network is None:
            from pdserve.kv_transfer.side_channel import ZmqNetwork
            network = ZmqNetwork(config.secret, config.previous_secret)
        self.engine_id = engine_id
        self.outcome = ConnectorOutcome()
        self.producer = ProducerSide(config, engine_id, fingerprint, rank_agents, network, self.outcome, clock,
                                     wake, caches)
        self.client = network.client()
        self.consumer = ConsumerSide(config, engine_id, fingerprint, len(rank_agents),
                                     fingerprint.num_kv_heads, self.client, self.outcome, clock, wake)
        self._ranks_polling = False
        self.warnings: dict[str, None] = {}  # what operators must know (a slow transport), in order

    # --- per request ----------------------------------------------------------------------------

    def add_request(self, request_id: str, params: KVTransferParams | None) -> None:
        """Last check before the engine keeps a request (raises InvalidRequestError); a consumer
        request's load starts here."""
        if params is not None and params.do_remote_prefill:
            self.consumer.add(request_id, params)
        elif params is not None and params.kv_holders:
            self.consumer.check_holders(params.kv_holders)

    def holder(self) -> dict:
        """What this instance signs of itself for producers to claim blocks from it (/health)."""
        return self.producer.holder().to_json()

    def abort(self, request_id: str) -> bool:
        """True when the engine must wait for the request's ABORTED outcome (READs in flight)."""
        return self.consumer.abort(request_id)

    def hand_off(self, request_id: str, prompt_token_ids: list[int], block_ids: list[int],
                 first_token: FirstToken, block_hashes: tuple[str, ...], num_cached_tokens: int = 0) -> Handoff:
        return self.producer.hand_off(request_id, prompt_token_ids, block_ids, first_token, block_hashes,
                                      num_cached_tokens)

    def request_finished(self, request_id: str) -> None:
        self.consumer.finished(request_id)

    def release_undelivered(self, request_id: str) -> bool:
        """A producer request that handed off was aborted: its client never got the params."""
        return self.producer.release_undelivered(request_id)

    def release_handoff(self, params: KVTransferParams) -> bool:
        """The proxy found no decode instance for these params: free the lease, unless a consumer
        already holds it (then that consumer decides)."""
        return self.producer.release_unclaimed(params)

    def num_leased_blocks(self) -> int:
        return self.producer.leases.num_blocks

    @property
    def busy(self) -> bool:
        """Leases held for readers, or loads in progress: a draining instance waits for them."""
        return self.producer.has_leases or bool(self.consumer.loads)

    # --- per step -------------------------------------------------------------------------------

    def step(self, step: StepIn) -> tuple[ConnectorOutcome, ConnectorMetadata | None]:
        """Once per engine step, after the ranks ran: take what the scheduler admitted, what the
        ranks reported and what the engine pinned, run timers and side-channel replies, and return
        every decision made since the last call, with what the ranks must do next step (None:
        nothing; they keep polling as last told)."""
        for load in step.loads:
            self.consumer.admit(load)
        for pull in step.pulls:
            self.consumer.pull(pull)
        self._process_reports(step.reports)
        self.producer.tick()
        self.consumer.tick()
        return self.outcome.take(), self._metadata()

    def grant(self, pinned: list[Pinned], metadata: ConnectorMetadata | None) -> ConnectorMetadata | None:
        """Answer the claims the engine pinned blocks for when it applied this step's outcome, at
        once rather than a step later (a busy holder's step may take seconds); `metadata`, what
        `step` returned for the ranks' next step, comes back telling them to poll for the readers'
        notifications if these are the first leases."""
        self.producer.grant(pinned)
        polling = self.producer.has_leases
        if polling == self._ranks_polling:
            return metadata
        self._ranks_polling = polling
        if metadata is None:
            return ConnectorMetadata(consumer_engine_id=self.engine_id, poll_notifications=polling)
        metadata.poll_notifications = polling
        return metadata

    def _process_reports(self, reports: list[ConnectorReport | None]) -> None:
        reports = [r or ConnectorReport() for r in reports]
        for r in reports:
            for w in r.warnings:
                self.warnings.setdefault(w, None)
        self.producer.process_notifications([n for r in reports for n in r.notifications],
                                            sum(r.num_bad_notifications for r in reports))
        self.consumer.process(reports)

    def _metadata(self) -> ConnectorMetadata | None:
        """Peers to load or drop, READs to post, and whether to poll notifications when that
        changed (the ranks keep the last value): None when the ranks have nothing new to do."""
        peers, evict, reads = self.consumer.build()
        polling = self.producer.has_leases
        if not (peers or evict or reads or polling != self._ranks_polling):
            return None
        self._ranks_polling = polling
        return ConnectorMetadata(consumer_engine_id=self.engine_id, load_peers=peers,
                                 evict_peers=evict, reads=reads, poll_notifications=polling)

    def needs_step(self) -> bool:
        """Side-channel replies or claims wait for the engine thread (they also wake it)."""
        return self.consumer.has_events or self.producer.has_claims or bool(self.outcome)

    def wakeup_in(self, now: float) -> float | None:
        """Seconds the engine loop may sleep before a timer needs a step (None: no timer): a lease
        expiring, a heartbeat due, a READ whose reports are overdue. Rank reports (a READ ended, a
        notification came) and side-channel replies wake the loop themselves."""
        timers = [t for t in (self.producer.next_deadline(), self.consumer.next_timer()) if t is not None]
        return max(0.0, min(timers) - now) if timers else None

    def stats(self, drain: bool) -> dict:
        c = self.consumer
        out = {"leases_active": len(self.producer.leases),
               "counters": {**c.counter_values(), **self.producer.counters()},
               "transfers": list(c.transfers), "handshake_latencies": list(c.peers.latencies),
               "num_handshakes_served": self.producer.num_handshakes_served,
               "side_channel_port": self.producer.server.port,
               "peers": sorted(c.peers.peers), "warnings": list(self.warnings)}
        if drain:
            c.transfers.clear()
            c.peers.take_latencies()
        return out

    def close(self) -> None:
        self.producer.close()
        self.client.close()


class NoConnector:
    """An instance started without P/D: refuses P/D params and never decides anything."""

    def add_request(self, request_id: str, params: KVTransferParams | None) -> None:
        if params is not None and (params.do_remote_decode or params.do_remote_prefill):
            raise InvalidRequestError("kv_transfer_params",
                                      "this instance was started without a KV transfer connector")

    def holder(self) -> None:
        return None

    def abort(self, request_id: str) -> bool:
        return False

    def hand_off(self, *args) -> Handoff:
        raise AssertionError("no request hands off without a connector")

    def request_finished(self, request_id: str) -> None:
        pass

    def release_handoff(self, params: KVTransferParams) -> bool:
        return False

    def release_undelivered(self, request_id: str) -> bool:
        return False

    def num_leased_blocks(self) -> int:
        return 0

    warnings: dict = {}

    busy = False

    def step(self, step: StepIn) -> tuple[ConnectorOutcome, None]:
        assert not step.loads and not step.pulls, "no request wants remote KV without a connector"
        return ConnectorOutcome(), None

    def needs_step(self) -> bool:
        return False

    def wakeup_in(self, now: float) -> None:
        return None

    def stats(self, drain: bool) -> None:
        return None

    def close(self) -> None:
        pass
