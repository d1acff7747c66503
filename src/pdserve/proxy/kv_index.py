"""Which instance caches which block: one exact index per instance, fed by its KV events.

Proxy process. Each instance that publishes events (its /health names the endpoints) gets a
follower thread of its own (its ZMQ sockets never leave it): it applies the batches in order and
repairs lost ones by replay or snapshot (prefix_cache/subscriber.py). An instance that leaves the
pool, restarts (a new engine id) or moves its endpoints loses its entries at once; a new follower
starts from a snapshot. Memory is one set of 64-bit hashes per instance, bounded by its blocks.
The event loop only reads the sets (`cached_blocks`). `drop_fraction` loses that share of every
instance's batches on purpose (seeded; off by default), for benchmarks of the repairs.
"""

from __future__ import annotations

import logging
import threading

from pdserve.health import Health
from pdserve.prefix_cache.subscriber import KVEventFollower, KVEventSubscriber, http_snapshot

logger = logging.getLogger("pdserve.proxy")


class _Follower:
    def __init__(self, url: str, key: tuple, endpoint: str, replay_endpoint: str | None, topic: str,
                 api_key: str | None, drop_fraction: float = 0.0, seed: int = 0):
        self.key = key
        self._stop = threading.Event()
        self._follower = KVEventFollower(KVEventSubscriber(endpoint, replay_endpoint, topic, drop_fraction, seed),
                                         http_snapshot(url, api_key))
        self._thread = threading.Thread(target=self._run, name=f"pdserve-kv-index-{url}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._follower.poll(0.1)
        except Exception:  # noqa: BLE001 - a broken stream leaves this instance unindexed, not the proxy down
            logger.exception("KV events of an instance could not be followed")
        finally:
            self._follower.subscriber.close()

    @property
    def hashes(self) -> set[int]:
        """The instance's blocks as its events say (a snapshot replaces the set: read it anew)."""
        return self._follower.index.hashes

    def published(self, seq: int) -> None:
        self._follower.published(seq)

    def repairs(self) -> dict[str, int]:
        """What this follower received, lost and repaired since it started."""
        f = self._follower
        return {"batches_received": f.subscriber.num_received, "batches_dropped": f.subscriber.num_dropped,
                "gaps": f.num_gaps, "batches_replayed": f.num_replayed, "snapshots": f.num_snapshots}

    def stop(self) -> None:
        self._stop.set()


class KVIndex:
    def __init__(self, api_key: str | None = None, drop_fraction: float = 0.0, seed: int = 0):
        self.api_key = api_key  # the instances' (their snapshot route is behind it)
        self._drop_fraction = drop_fraction
        self._seed = seed  # the n-th follower started drops with seed + n
        self._num_started = 0
        self._followers: dict[str, _Follower] = {}

    def update(self, url: str, report: Health | None) -> None:
        """After a probe: follow the instance's events, or stop when it has none, restarted or
        moved them (its old entries go at once); tell the follower the last batch published."""
        events = report.prefix_cache.kv_events if report is not None and report.prefix_cache else None
        key = (report.engine_id, events.endpoint, events.replay_endpoint, events.topic) if events else None
        current = self._followers.get(url)
        if current is None or current.key != key:
            self.drop(url)
            if key is None:
                return
            current = self._followers[url] = _Follower(
                url, key, events.endpoint, events.replay_endpoint, events.topic, self.api_key,
                self._drop_fraction, self._seed + self._num_started)
            self._num_started += 1
        current.published(events.last_seq)  # a last batch lost after the follower's quiet check

    def drop(self, url: str) -> None:
        follower = self._followers.pop(url, None)
        if follower is not None:
            follower.stop()

    def cached_blocks(self, url: str, hashes: list[int]) -> int:
        """How many of the prompt's leading full blocks the instance caches (0 when unindexed)."""
        follower = self._followers.get(url)
        if follower is None:
            return 0
        held = follower.hashes
        n = 0
        for h in hashes:
            if h not in held:
                break
            n += 1
        return n

    def indexed(self, url: str) -> set[int] | None:
        follower = self._followers.get(url)
        return None if follower is None else set(follower.hashes)

    def repairs(self, url: str) -> dict[str, int] | None:
        follower = self._followers.get(url)
        return None if follower is None else follower.repairs()

    def close(self) -> None:
        for url in list(self._followers):
            self.drop(url)
