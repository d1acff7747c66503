"""Scheduler: admission against `--max-num-seqs`, on a BlockPool and Scheduler directly."""

from __future__ import annotations

from pdserve.config import SchedulerConfig
from pdserve.engine.block_pool import BlockPool
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.scheduler import Scheduler
from pdserve.kv_transfer.params import FirstToken, KVTransferParams
from pdserve.sampling_params import SamplingParams

BLOCK_SIZE = 4


def _local(request_id: str) -> Request:
    return Request(request_id, [1, 2, 3, 4, 5], SamplingParams(), (), 8)


def _remote(request_id: str) -> Request:
    """A P/D consumer request: its prompt's KV comes from a producer."""
    kv = KVTransferParams(do_remote_prefill=True, remote_engine_id="p", remote_host="127.0.0.1",
                          remote_port=1, remote_block_ids=(0, 1), remote_request_id=request_id,
                          producer_tp_size=1, first_token=FirstToken(7))
    return Request(request_id, [1, 2, 3, 4, 5], SamplingParams(), (), 8, kv)


def _scheduler(max_num_seqs: int) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs), BlockPool(64, BLOCK_SIZE))


def _num_admitted(s: Scheduler) -> int:
    return len(s.running) + len(s.loading)


def test_requests_loading_remote_kv_count_against_max_num_seqs_for_local_ones():
    s = _scheduler(max_num_seqs=2)
    s.add(_remote("remote-0"))
    s.add(_remote("remote-1"))
    s.schedule()
    assert [r.status for r in s.loading] == [RequestStatus.WAITING_FOR_REMOTE_KV] * 2
    s.add(_local("local"))
    out = s.schedule()
    assert not out.chunks and _num_admitted(s) == 2  # the local one waits for a slot
    for r in list(s.loading):  # the loads land: running never exceeds the limit
        s.remote_kv_loaded(r)
    assert len(s.running) == 2
    s.finish(s.running[0], RequestStatus.FINISHED_STOPPED)
    out = s.schedule()
    assert [c.request_id for c in out.chunks if c.request_id == "local"] == ["local"]
    assert len(s.running) == 2


def test_remote_requests_count_running_and_loading_ones():
    s = _scheduler(max_num_seqs=2)
    s.add(_local("local"))
    s.add(_remote("remote-0"))
    s.add(_remote("remote-1"))
    s.schedule()
    assert _num_admitted(s) == 2 and [r.request_id for r in s.waiting] == ["remote-1"]
