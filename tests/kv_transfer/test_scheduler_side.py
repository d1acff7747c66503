"""The connector's face to the engine: outcomes handed over once, steps skipped when the ranks have
nothing to do, timers, and the no-P/D stand-in."""

from __future__ import annotations

import pytest

from pdserve.kv_transfer.outcomes import ConnectorOutcome, LoadOutcome, LoadResult
from pdserve.kv_transfer.params import KVTransferParams
from pdserve.kv_transfer.scheduler_side import LEASE_POLL_S, POLL_S, NoConnector
from pdserve.sampling_params import InvalidRequestError


def test_outcomes_are_handed_over_once():
    buf = ConnectorOutcome()
    buf.loads.append(LoadOutcome("r", LoadResult.LOADED))
    buf.free_blocks.extend([1, 2])
    assert buf
    taken = buf.take()
    assert taken.loads[0].request_id == "r" and taken.free_blocks == [1, 2]
    assert not buf and not buf.take()


def test_no_connector_refuses_pd_params_and_decides_nothing():
    c = NoConnector()
    c.add_request("r", None)
    c.add_request("r", KVTransferParams.parse({"do_remote_decode": False}))
    with pytest.raises(InvalidRequestError) as e:
        c.add_request("r", KVTransferParams.parse({"do_remote_decode": True}))
    assert e.value.field == "kv_transfer_params"
    assert not c.tick() and c.build_metadata() is None and not c.needs_step()
    assert c.wakeup_in(0.0) is None and c.abort("r") is False


def test_an_idle_connector_skips_steps_and_sleeps(world):
    inst = world.instance("P", 1, lease_s=9.0)
    c = inst.connector
    assert c.build_metadata() is None and c.wakeup_in(world.clock()) is None
    inst.prefill("p1", 5)
    meta = c.build_metadata()
    assert meta is not None and meta.poll_notifications  # leased blocks: the ranks poll
    assert c.wakeup_in(world.clock()) == LEASE_POLL_S
    world.clock.advance(10)
    inst.step()  # the lease expired (blocks freed): the ranks are told to stop polling, once
    assert not inst.workers[0]._polling and c.build_metadata() is None


def test_a_consumer_wakes_for_heartbeats_and_polls_while_reading(world):
    p = world.instance("P", 1, lease_s=9.0)
    d = world.instance("D", 1, lease_s=9.0)
    world.fabric.read_delay_s = 1.0
    d.receive("r1", p.prefill("p1", 5))
    assert d.connector.wakeup_in(world.clock()) == pytest.approx(3.0)  # a third of the lease
    d.admit("r1", 5)
    world.run(2)
    assert d.connector.wakeup_in(world.clock()) == POLL_S
