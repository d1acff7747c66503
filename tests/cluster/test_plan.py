"""The Ray driver's decisions, as pure logic: how many instances to start, which to stop (newest and
not-yet-serving first), which to route to, what `pdserve ray status` shows."""

from __future__ import annotations

import pytest

from pdserve.cluster.plan import Member, changes, check_counts, routes, status


def serving(role: str, url: str) -> Member:
    return Member(role, actor=object(), info={"alive": True, "url": url, "host": "10.0.0.1"})


def test_start_what_is_missing():
    have = [serving("prefill", "http://p0")]
    assert changes({"prefill": 2, "decode": 1}, have) == ({"prefill": 1, "decode": 1}, [])


def test_stop_the_newest_and_the_ones_not_serving_first():
    old, new = serving("decode", "http://d0"), serving("decode", "http://d1")
    starting = Member("decode", actor=object())
    members = [old, starting, new, serving("prefill", "http://p0")]
    assert changes({"prefill": 1, "decode": 2}, members) == ({}, [starting])
    assert changes({"prefill": 1, "decode": 1}, members) == ({}, [starting, new])
    assert [m.role for m in changes({"prefill": 0, "decode": 1}, members)[1]] == ["prefill", "decode", "decode"]


def test_only_serving_instances_are_routed():
    down = Member("decode", actor=object(), info={"alive": False, "state": "down", "error": "ActorDiedError"})
    members = [serving("prefill", "http://p0"), down, serving("decode", "http://d1")]
    assert routes(members) == {"prefill": ["http://p0"], "decode": ["http://d1"]}
    s = status({"prefill": 1, "decode": 2}, members, "http://proxy")
    assert s["ready"] == {"prefill": 1, "decode": 1}
    assert [i["role"] for i in s["instances"]] == ["prefill", "decode", "decode"]
    assert s["instances"][1]["error"] == "ActorDiedError"


def test_counts_are_checked():
    check_counts(0, 1)
    check_counts(None, None)  # unchanged
    with pytest.raises(ValueError, match="decode"):
        check_counts(1, 0)
    with pytest.raises(ValueError, match="prefill"):
        check_counts(-1, 1)
