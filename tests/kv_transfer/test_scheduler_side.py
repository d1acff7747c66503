"""The connector's face to the engine: one call per step, outcomes handed over once, metadata only
when the ranks have something new to do, timers instead of polling steps, and the no-P/D stand-in."""

from __future__ import annotations

import pytest

from pdserve.kv_transfer.consumer import REPORT_GRACE_S
from pdserve.kv_transfer.outcomes import ConnectorOutcome, LoadOutcome, Pin, StepIn
from pdserve.kv_transfer.params import KVTransferParams
from pdserve.kv_transfer.scheduler_side import NoConnector
from pdserve.kv_transfer.transfer_state import TransferState
from pdserve.sampling_params import InvalidRequestError


def test_outcomes_are_handed_over_once():
    buf = ConnectorOutcome()
    buf.loads.append(LoadOutcome("r", TransferState.KV_LOADED))
    buf.free_blocks.extend([1, 2])
    buf.pins.append(Pin(0, [b"h"]))
    assert buf
    taken = buf.take()
    assert taken.loads[0].request_id == "r" and taken.free_blocks == [1, 2] and taken.pins[0].claim_id == 0
    assert not buf and not buf.take()


def test_no_connector_refuses_pd_params_and_decides_nothing():
    c = NoConnector()
    c.add_request("r", None)
    c.add_request("r", KVTransferParams.parse({"do_remote_decode": False}))
    with pytest.raises(InvalidRequestError) as e:
        c.add_request("r", KVTransferParams.parse({"do_remote_decode": True}))
    assert e.value.field == "kv_transfer_params"
    outcome, meta = c.step(StepIn())
    assert not outcome and meta is None and not c.needs_step()
    assert c.wakeup_in(0.0) is None and c.abort("r") is False


def test_an_idle_connector_tells_the_ranks_nothing_and_sleeps(world):
    p = world.instance("P", 1, lease_s=9.0)
    c = p.connector
    world.run(3)
    assert p.steps_with_metadata == 0 and c.wakeup_in(world.clock()) is None


def test_a_producer_holding_a_lease_sleeps_until_it_expires(world):
    """The ranks are told once to poll notifications (and collect them themselves); the engine has
    no reason to step until the lease expires or a rank reports a notification."""
    p = world.instance("P", 1, lease_s=9.0)
    p.prefill("p1", 5)
    world.run(4)
    assert p.steps_with_metadata == 1 and p.workers[0]._polling
    assert p.connector.wakeup_in(world.clock()) == pytest.approx(9.0)
    assert not p.connector.needs_step()
    world.clock.advance(10)
    world.run(3)  # the lease expired (blocks freed): the ranks are told to stop polling, once
    assert p.num_free == p.pool.num_blocks
    assert not p.workers[0]._polling and p.steps_with_metadata == 2
    assert p.connector.wakeup_in(world.clock()) is None


def test_a_consumer_sleeps_while_reading_until_the_reports_are_overdue(world):
    """No step every millisecond while a READ is in flight: its ranks report when it ends, and the
    only timers are the heartbeat and the READ's report deadline (its timeout, plus a grace)."""
    p = world.instance("P", 1, lease_s=9.0)
    d = world.instance("D", 1, lease_s=9.0, transfer_timeout_s=10.0)
    world.fabric.read_delay_s = 5.0
    d.receive("r1", p.prefill("p1", 5))
    assert d.connector.wakeup_in(world.clock()) == pytest.approx(3.0)  # a third of the lease
    d.admit("r1", 5)
    world.run(3)
    assert d.outcome("r1") is None and d.connector.consumer.loads["r1"].state == TransferState.READING
    assert d.connector.wakeup_in(world.clock()) == pytest.approx(3.0)  # the next heartbeat, not a poll
    world.clock.advance(3.0)
    world.run(1)  # the heartbeat goes; the READ is still in flight
    assert d.outcome("r1") is None and d.connector.wakeup_in(world.clock()) == pytest.approx(3.0)
    world.clock.advance(2.5)  # the READ landed: its rank reports it at the next step
    world.run(2)
    assert d.outcome("r1").state == TransferState.KV_LOADED


def test_a_read_whose_reports_never_come_ends_at_its_report_deadline(world):
    p = world.instance("P", 1, lease_s=60.0)
    d = world.instance("D", 1, lease_s=60.0, transfer_timeout_s=2.0)
    world.fabric.hang_reads = True
    d.receive("r1", p.prefill("p1", 9))
    d.admit("r1", 9)
    world.run(2)
    due = d.connector.consumer.loads["r1"].reports_due
    assert due - world.clock() <= 2.0 + REPORT_GRACE_S
    for w in d.workers:
        w.report = lambda: None  # the ranks stop reporting
    world.clock.t = due + 0.01
    world.run(1)
    o = d.outcome("r1")
    assert o.state == TransferState.FAILED and o.quarantine_until is not None
