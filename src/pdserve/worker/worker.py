"""One TP rank: its model shard, its KV cache, its sampler (rank 0) and its half of the connector.

Rank 0 lives in the engine process; ranks 1..N-1 run `rank_main` in child processes spawned by the
executor. A rank executes exactly what the engine's `StepInput` says and reports back; between
steps its connector may only say that it has something to report (`on_report`: an empty message on
its own pipe, for a child), so that the engine steps to collect it.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import os
import signal
import sys
import time
import traceback
from multiprocessing.connection import Connection
from typing import Callable

import msgspec
import torch

from pdserve.config import EngineConfig, KVTransferConfig
from pdserve.heap import freeze_startup_heap
from pdserve.model import kv_dtype
from pdserve.model.loader import load_model
from pdserve.model.parallel import TPGroup, kv_head_range, make_group
from pdserve.model.spec import ModelSpec, resolve_dtype
from pdserve.structured.matchers import Matchers
from pdserve.worker.kv_cache import CacheLayout, KVCache
from pdserve.worker.messages import (DebugCall, DebugResult, RankReady, Shutdown, StepInput,
                                     StepOutput)
from pdserve.worker.mock_runner import MockRunner
from pdserve.worker.model_runner import ModelRunner
from pdserve.worker.sampler import Sampler, score_prompt

logger = logging.getLogger(__name__)

# A server process runs its event loop, engine thread and rank 0's NIXL thread under one GIL, a rank
# process its step loop and NIXL thread. CPython's default 5 ms switch interval let a busy thread
# delay a streamed token or a KV READ by that much per handoff (a raw NIXL read loop beside a busy
# thread moved 1.7 GB/s at 5 ms, 4.8 GB/s at 0.5 ms).
GIL_SWITCH_INTERVAL_S = 0.001


def tune_allocator() -> None:
    """Keep freed memory in the heap instead of returning it to the kernel: every step allocates
    the same large temporaries, and fresh mmap pages cost a page fault each (measured: 4x on the
    KV gather of a batch-32 decode step)."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, 1 << 30)  # M_MMAP_THRESHOLD
    libc.mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD


class Worker:
    def __init__(self, config: EngineConfig, rank: int, num_blocks: int, engine_id: str,
                 store_port: int = 0, store=None, on_report: Callable[[], None] = lambda: None):
        self.config, self.rank = config, rank
        tune_allocator()
        torch.set_num_threads(config.threads_per_rank())
        tp_size = config.parallel.tensor_parallel_size
        self.tp: TPGroup = make_group(rank, tp_size, config.parallel.dist_host, store_port,
                                      config.parallel.dist_timeout_s, store)
        spec = ModelSpec.from_dir(config.model)
        dtype = resolve_dtype(config.dtype, spec)
        self.model = None if config.mock_engine else load_model(config.model, spec, self.tp, dtype,
                                                                  config.quantization)
        kv_name = kv_dtype.resolve(config.cache.kv_cache_dtype, dtype)
        layout = CacheLayout.for_dtype(spec.num_layers, num_blocks,
                                       len(kv_head_range(rank, tp_size, spec.num_kv_heads)),
                                       config.cache.block_size, spec.head_dim, kv_name)
        self.kv_cache = KVCache(layout, kv_dtype.torch_dtype(kv_name))
        self.runner = MockRunner(self.kv_cache, spec.vocab_size, speedup=config.mock_speedup) \
            if config.mock_engine else ModelRunner(self.model, self.kv_cache)
        self.sampler = Sampler(spec.vocab_size, Matchers(config.model, spec.vocab_size, spec.eos_token_ids)) \
            if rank == 0 else None
        self.connector = None
        self.step_delay_s = 0.0  # a test hook (`/debug/step_delay`): every model step takes this longer
        if config.kv_transfer is not None:
            self.connector = kv_connector(config.kv_transfer, spec, rank, tp_size, self.kv_cache,
                                          engine_id, on_report)

    def rank_agent(self):
        return self.connector.rank_agent() if self.connector else None

    def execute(self, step: StepInput) -> StepOutput:
        if self.connector is not None and step.connector is not None:
            self.connector.start_step(step.connector)
        if self.sampler is not None:
            for rid in step.finished_request_ids:
                self.sampler.remove(rid)
            for new in step.new_requests:
                self.sampler.add(new.request_id, new.sampling)
        sampled, scored = [], []
        if step.chunks:
            if self.step_delay_s:
                time.sleep(self.step_delay_s)
            logits, request_ids, prompt_logits = self.runner.execute(step.chunks)
            if self.sampler is not None and request_ids:
                sampled = self.sampler.sample(logits, request_ids)
            if self.sampler is not None:
                scored = [score_prompt(c, rows) for c, rows in prompt_logits]
        report = self.connector.report() if self.connector is not None else None
        return StepOutput(rank=self.rank, sampled=sampled, connector=report, prompt_logprobs=scored)

    def debug(self, call: DebugCall) -> DebugResult:
        if call.name == "checksum":
            return DebugResult(self.rank, self.kv_cache.checksum(call.args[0]))
        if call.name == "perturb":  # add noise to the given blocks' K/V (tests prove KV is used)
            with torch.inference_mode():
                blocks = torch.tensor(call.args[0], dtype=torch.long)
                self.kv_cache.buffer[:, :, blocks] += float(call.args[1])
            return DebugResult(self.rank)
        if call.name == "gc_frozen":
            return DebugResult(self.rank, gc.get_freeze_count())
        if call.name == "step_delay":  # a slow model, for tests of what must not wait for a step
            self.step_delay_s = float(call.args[0])
            return DebugResult(self.rank)
        if call.name == "loaded_peers":
            return DebugResult(self.rank, self.connector.loaded_peers() if self.connector else [])
        return DebugResult(self.rank, error=f"unknown debug call {call.name!r}")

    def close(self) -> None:
        if self.connector is not None:
            self.connector.close()


def kv_connector(config: KVTransferConfig, spec: ModelSpec, rank: int, tp_size: int,
                 kv_cache: KVCache, engine_id: str, on_report: Callable[[], None] = lambda: None):
    """This rank's half of the connector, on its cache, over NIXL."""
    from pdserve.kv_transfer.worker_side import WorkerConnector
    from pdserve.transport.nixl_agent import NixlAgent
    return WorkerConnector(config, spec.num_kv_heads, rank, tp_size, kv_cache.registration(), engine_id,
                           lambda name: NixlAgent(name, config.backend), on_report=on_report)


_decoder = msgspec.msgpack.Decoder(StepInput | Shutdown | DebugCall)
_encoder = msgspec.msgpack.Encoder()


def die_with_parent() -> None:
    """PR_SET_PDEATHSIG: the kernel kills this process when the thread that spawned it exits."""
    parent = os.getppid()
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


def _announce(conn: Connection) -> None:
    try:
        conn.send_bytes(b"")
    except OSError:  # the engine is gone; this rank ends with it
        pass


def rank_main(config: EngineConfig, rank: int, num_blocks: int, engine_id: str, store_port: int,
              conn: Connection, report_conn: Connection) -> None:
    """Entry point of TP ranks 1..N-1 (spawned). Answers every step on `conn` until told to stop;
    an empty message on `report_conn` (written only by the connector's transport thread) says the
    next step has a connector report to collect."""
    die_with_parent()
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)  # this rank's NIXL thread beside its step loop
    if config.parallel.rank_cpus:
        os.sched_setaffinity(0, config.parallel.rank_cpus[rank])
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{rank} %(levelname)s %(message)s")
    try:
        worker = Worker(config, rank, num_blocks, engine_id, store_port, on_report=lambda: _announce(report_conn))
    except Exception:
        conn.send_bytes(_encoder.encode(RankReady(rank, error=traceback.format_exc())))
        sys.exit(1)
    conn.send_bytes(_encoder.encode(RankReady(rank, agent=worker.rank_agent())))
    freeze_startup_heap()
    try:
        while True:
            try:
                msg = _decoder.decode(conn.recv_bytes())
            except EOFError:
                break
            if isinstance(msg, Shutdown):
                break
            if isinstance(msg, DebugCall):
                conn.send_bytes(_encoder.encode(worker.debug(msg)))
                continue
            try:
                out = worker.execute(msg)
            except Exception:
                out = StepOutput(rank, [], error=traceback.format_exc())
            conn.send_bytes(_encoder.encode(out))
    finally:
        worker.close()
