"""A P/D engine steps only when something happened (docs/design.md, "The connector seam"): holding a
lease or waiting for a READ, it sleeps until a timer is due or a rank's report wakes it. Two engines
in this process over real NIXL, driven as the server's loop drives them: a TP 2 producer (its rank 1
a child process, which says it has a report on a pipe of its own) and a TP 1 consumer."""

from __future__ import annotations

import threading
import time

import pytest

from helpers import ids
from pdserve.config import CacheConfig, EngineConfig, KVTransferConfig, ParallelConfig
from pdserve.engine.engine import Engine
from pdserve.kv_transfer.params import KVTransferParams
from pdserve.sampling_params import SamplingParams

LEASE_S = 30.0


class Loop:
    """The server's engine loop in short: a step (as after each command), then more while the
    engine needs them, else sleep until woken or its next timer (never longer than the test allows)."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.woken = threading.Event()
        engine.wake = self.woken.set
        self.outputs = []
        self.num_steps = 0

    def run(self, until, timeout_s: float = 20.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            self.woken.clear()
            self.outputs += self.engine.step()
            self.num_steps += 1
            if until():
                return
            left = deadline - time.monotonic()
            assert left > 0, "the engine did not get there in time (asleep?)"
            if not self.engine.needs_step():
                timer = self.engine.wakeup_in()
                self.woken.wait(left if timer is None else min(left, timer))

    def finished(self, request_id: str):
        return next((o for o in self.outputs if o.request_id == request_id and o.finished), None)


def engine(model: str, tp: int) -> Engine:
    return Engine(EngineConfig(
        model=model, num_threads=1, cache=CacheConfig(block_size=16, num_blocks=64),
        parallel=ParallelConfig(tensor_parallel_size=tp),
        kv_transfer=KVTransferConfig(lease_s=LEASE_S, transfer_timeout_s=10.0, handshake_timeout_s=5.0)))


@pytest.fixture(scope="module")
def pair(tiny_model):
    producer, consumer = engine(tiny_model, 2), engine(tiny_model, 1)
    yield Loop(producer), Loop(consumer)
    producer.shutdown()
    consumer.shutdown()


def test_a_producer_holding_a_lease_sleeps_and_its_ranks_wake_it_when_read(pair):
    producer, consumer = pair
    prompt = ids(40, seed=3)
    producer.engine.add_request("p1", prompt, SamplingParams(temperature=0, max_tokens=1),
                                KVTransferParams.parse({"do_remote_decode": True}))
    producer.run(lambda: producer.finished("p1") and not producer.engine.needs_step())
    params = producer.finished("p1").kv_transfer_params
    assert producer.engine.connector.num_leased_blocks() == 3
    # nothing to do until the lease expires or a rank hears a reader: no step every few ms
    assert producer.engine.wakeup_in() == pytest.approx(LEASE_S, abs=2.0)

    consumer.engine.add_request("d1", prompt, SamplingParams(temperature=0, max_tokens=4),
                                KVTransferParams.parse(params))
    consumer.run(lambda: consumer.finished("d1"), timeout_s=8.0)  # its rank reports the READ's end
    out = consumer.finished("d1")
    assert out.finish_reason == "length" and out.error is None

    steps = producer.num_steps
    producer.run(lambda: producer.engine.connector.num_leased_blocks() == 0, timeout_s=8.0)
    assert producer.num_steps - steps <= 3  # woken by its ranks' notifications, not by a poll
    assert producer.engine.pool.num_free_blocks == producer.engine.num_blocks


def test_the_copy_the_proxy_calls_spare_is_freed_to_be_reused_first(pair):
    """`spare_copy` on the producer: after decode read the lease, the producer's cached blocks of
    the prompt wait in its spare list and decode's in its cache proper; on decode, the other way."""
    producer, consumer = pair
    for i, (p_spare, d_spare) in enumerate(((True, False), (False, True))):
        prompt = ids(40, seed=10 + i)  # 2 full blocks and a partial one
        producer.engine.add_request(f"sp{i}", prompt, SamplingParams(temperature=0, max_tokens=1),
                                    KVTransferParams.parse({"do_remote_decode": True, "spare_copy": p_spare}))
        producer.run(lambda i=i: producer.finished(f"sp{i}") and not producer.engine.needs_step())
        params = dict(producer.finished(f"sp{i}").kv_transfer_params, spare_copy=d_spare)
        consumer.engine.add_request(f"sd{i}", prompt, SamplingParams(temperature=0, max_tokens=4),
                                    KVTransferParams.parse(params))
        consumer.run(lambda i=i: consumer.finished(f"sd{i}"), timeout_s=8.0)
        producer.run(lambda: producer.engine.connector.num_leased_blocks() == 0, timeout_s=8.0)
        for loop, spare in ((producer, p_spare), (consumer, d_spare)):
            pool = loop.engine.pool
            full = [pool.cached[h] for h in pool.block_hashes(_probe(prompt), 2)]
            assert set(full) <= set(pool.spare if spare else pool.free), (loop is producer, spare)


def test_a_producer_that_keeps_its_copy_keeps_it_when_a_spare_copy_shares_it(pair):
    """Its kept copy (a conversation the proxy keeps on producers) stays in the cache proper when a
    later request whose copy is the spare reuses the same blocks (a shared system prompt, a history
    another instance now keeps): kept wins, as on decode. Were it demoted, the chain's head would go
    first and leave its tail cached but unreachable."""
    producer, consumer = pair
    prompt = ids(40, seed=20)
    for i, p_spare in enumerate((False, True)):
        producer.engine.add_request(f"kp{i}", prompt, SamplingParams(temperature=0, max_tokens=1),
                                    KVTransferParams.parse({"do_remote_decode": True, "spare_copy": p_spare}))
        producer.run(lambda i=i: producer.finished(f"kp{i}") and not producer.engine.needs_step())
        consumer.engine.add_request(f"kd{i}", prompt, SamplingParams(temperature=0, max_tokens=2),
                                    KVTransferParams.parse(producer.finished(f"kp{i}").kv_transfer_params))
        consumer.run(lambda i=i: consumer.finished(f"kd{i}"), timeout_s=8.0)
        producer.run(lambda: producer.engine.connector.num_leased_blocks() == 0, timeout_s=8.0)
    pool = producer.engine.pool
    full = [pool.cached[h] for h in pool.block_hashes(_probe(prompt), 2)]
    assert set(full) <= set(pool.free)


def _probe(prompt):
    from pdserve.engine.request import Request
    return Request("probe", prompt, SamplingParams(), (), 1)
