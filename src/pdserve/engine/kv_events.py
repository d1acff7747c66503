"""The prefix cache as other processes see it: the instance's KV events publisher, its snapshot, and
what /health says about both and about the hashes.

Engine process, engine thread (the publisher has its own thread). With events enabled the pool
reports every stored, removed and cleared block to the publisher as it happens.
"""

from __future__ import annotations

from pdserve.config import KVEventsConfig
from pdserve.engine.block_pool import BlockPool
from pdserve.health import PrefixCacheInfo
from pdserve.prefix_cache.events import Snapshot
from pdserve.prefix_cache.hashing import HASH_ALGORITHM, HASH_SEED
from pdserve.prefix_cache.publisher import KVEventPublisher


class KVEvents:
    def __init__(self, config: KVEventsConfig, engine_id: str, pool: BlockPool):
        self.pool = pool
        self.publisher: KVEventPublisher | None = None
        if config.enabled:
            topic = config.topic or f"kv@{config.role}@{engine_id}"
            self.publisher = KVEventPublisher(config, topic)
            pool.on_events = self.publisher.emit

    def snapshot(self) -> Snapshot | None:
        """Every cached block, consistent with the batches published up to the returned `seq`
        (queued events are sealed first); None when events are off."""
        if self.publisher is None:
            return None
        seq = self.publisher.flush()
        return Snapshot(seq=seq, topic=self.publisher.topic, blocks=self.pool.cached_blocks())

    def info(self) -> PrefixCacheInfo:
        """For /health: how a router recomputes this instance's block hashes, and where its events are."""
        return PrefixCacheInfo(hash_algorithm=HASH_ALGORITHM, hash_seed=HASH_SEED, model_key=self.pool.model_key,
                               block_size=self.pool.block_size, enabled=self.pool.enable_prefix_caching,
                               kv_events=self.publisher.info() if self.publisher is not None else None)

    def close(self) -> None:
        if self.publisher is not None:
            self.pool.on_events = None
            self.publisher.close()
