"""The scheduler side of the KV connector: what the engine and scheduler talk to.

Engine process. Composes the two roles (an instance can produce for one request and consume for
another) and speaks to the TP ranks only through per-step `ConnectorMetadata` down and per-step
`ConnectorReport`s up.
"""

from __future__ import annotations

import time

from pdserve.config import KVTransferConfig
from pdserve.engine.request import Request
from pdserve.kv_transfer.consumer import ConsumerSide
from pdserve.kv_transfer.messages import ConnectorMetadata, ConnectorReport, Fingerprint, RankAgent
from pdserve.kv_transfer.producer import ProducerSide

POLL_S = 0.001  # step cadence while READs are in flight (their completion reports come up per step)
LEASE_POLL_S = 0.002  # while this instance holds leased blocks (ranks poll NIXL every 1 ms themselves)


def fingerprint_of(engine) -> Fingerprint:
    spec = engine.spec
    return Fingerprint(model=spec.fingerprint(), dtype=str(engine.dtype).replace("torch.", ""),
                       num_layers=spec.num_layers, num_kv_heads=spec.num_kv_heads,
                       head_dim=spec.head_dim, block_size=engine.config.cache.block_size)


class SchedulerConnector:
    def __init__(self, engine, config: KVTransferConfig, rank_agents: list[RankAgent]):
        self.engine = engine
        self.fingerprint = fingerprint_of(engine)
        self.producer = ProducerSide(engine, config, rank_agents, self.fingerprint)
        self.consumer = ConsumerSide(engine, config, self.fingerprint, len(rank_agents))
        self._ranks_polling = False

    # --- per request ----------------------------------------------------------------------------

    @staticmethod
    def is_producer(request: Request) -> bool:
        return request.kv_transfer is not None and request.kv_transfer.do_remote_decode

    @staticmethod
    def wants_remote_kv(request: Request) -> bool:
        return request.kv_transfer is not None and request.kv_transfer.do_remote_prefill \
            and not request.kv_load_failed

    def claim(self, params) -> None:
        """Called by add_request for a consumer request (may raise InvalidRequestError)."""
        self.consumer.claim(params)

    def start_load(self, request: Request) -> None:
        self.consumer.start(request)

    def abort_load(self, request: Request) -> bool:
        return self.consumer.abort(request)

    def request_finished(self, request: Request) -> bool:
        """True when the producer keeps the blocks for a remote reader."""
        if self.wants_remote_kv(request):
            self.consumer.request_finished(request)
        return self.producer.request_finished(request)

    @property
    def num_loading(self) -> int:
        return len(self.consumer.loads)

    def take_transfer_params(self, request: Request) -> dict | None:
        return self.producer.take_params(request)

    # --- per step -------------------------------------------------------------------------------

    def tick(self) -> None:
        now = time.monotonic()
        self.producer.tick(now)
        self.consumer.tick(now)

    def build_metadata(self) -> ConnectorMetadata | None:
        """None when the ranks have nothing to do and nothing to report (the step can be skipped)."""
        peers, evict, reads = self.consumer.build()
        polling = self.producer.has_leases
        if not (peers or evict or reads or polling or self._ranks_polling or self.consumer.is_reading):
            return None
        self._ranks_polling = polling
        return ConnectorMetadata(consumer_engine_id=self.engine.engine_id, load_peers=peers,
                                 evict_peers=evict, reads=reads, poll_notifications=polling)

    def process_reports(self, reports: list[ConnectorReport | None]) -> None:
        reports = [r or ConnectorReport() for r in reports]
        self.producer.process_notifications([n for r in reports for n in r.notifications],
                                            sum(r.num_bad_notifications for r in reports))
        self.consumer.process(reports)

    def needs_step(self) -> bool:
        return self.consumer.has_ready

    def wakeup_in(self) -> float:
        """Seconds the engine loop may sleep before the connector needs a step."""
        if self.consumer.is_reading:
            return POLL_S
        if self.producer.has_leases:
            return LEASE_POLL_S
        now = time.monotonic()
        timers = [t for t in (self.producer.next_deadline(), self.consumer.next_heartbeat())
                  if t is not None]
        return max(0.0, min(timers) - now) if timers else 1.0

    def stats(self, drain: bool) -> dict:
        c = self.consumer
        out = {"leases_active": len(self.producer.leases),
               "counters": {**c.counter_values(), **self.producer.counters()},
               "transfers": list(c.transfers), "handshake_latencies": list(c.peers.latencies),
               "num_handshakes_served": self.producer.num_handshakes_served,
               "side_channel_port": self.producer.server.port,
               "peers": sorted(c.peers.peers)}
        if drain:
            c.transfers.clear()
            c.peers.latencies.clear()
        return out

    def close(self) -> None:
        self.producer.close()
        self.consumer.close()
