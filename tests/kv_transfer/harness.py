"""An in-process P/D pair for the connector's unit tests, in milliseconds and without a model.

Each `Instance` is the real scheduler-side connector and one real worker-side connector per TP rank
(no threads: a step runs them in turn), a real BlockPool, KV caches in numpy arrays, the loopback
fabric and network (transport/loopback.py) and a fake clock. `step` is an engine step without the
model: the ranks run with the last step's metadata, then one connector call (what was admitted,
the ranks' reports) and one apply of its outcome, whose pins are granted at once. Producer blocks
are filled with a pattern that names (request, layer, K/V, global head, position, dim), so a test
checks the consumer received exactly the right bytes for any pair of TP sizes.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from pdserve.config import KVTransferConfig
from pdserve.engine.block_pool import BlockPool
from pdserve.kv_transfer.descriptors import RegionTable
from pdserve.kv_transfer.messages import ConnectorMetadata, Fingerprint
from pdserve.kv_transfer.outcomes import (ConnectorOutcome, LoadOutcome, Pinned, RemoteLoad, RemotePull,
                                          StepIn)
from pdserve.kv_transfer.params import FirstToken, KVTransferParams
from pdserve.kv_transfer.scheduler_side import SchedulerConnector
from pdserve.kv_transfer.transfer_state import TransferState
from pdserve.kv_transfer.worker_side import RegisteredCache, WorkerConnector
from pdserve.model import kv_dtype
from pdserve.model.parallel import kv_head_range
from pdserve.prefix_cache.hashing import hash_blocks, wire_hash
from pdserve.transport.loopback import LoopbackFabric, LoopbackNetwork
from pdserve.worker.kv_cache import CacheLayout, KVCache

NUM_LAYERS, HEAD_DIM, BLOCK_SIZE = 2, 2, 4


class Clock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


def config(**kw) -> KVTransferConfig:
    kw = {"lease_s": 30.0, "handshake_timeout_s": 5.0, "transfer_timeout_s": 10.0, **kw}
    return KVTransferConfig(**kw)


class Instance:
    def __init__(self, name: str, tp_size: int, world: "World", num_kv_heads: int = 4, num_blocks: int = 32,
                 model: str = "m", prefix_caching: bool = False, kv_cache_dtype: str = "float32", **config_kw):
        self.engine_id = name
        self.tp_size = tp_size
        self.world = world
        self.num_kv_heads = num_kv_heads
        self.pool = BlockPool(num_blocks, BLOCK_SIZE, enable_prefix_caching=prefix_caching, model_key=model)
        self.config = config(**config_kw)
        self.local_heads = [kv_head_range(r, tp_size, num_kv_heads) for r in range(tp_size)]
        self.kv_dtype = kv_cache_dtype
        self.kv_caches = [KVCache(CacheLayout.for_dtype(NUM_LAYERS, num_blocks, len(h), BLOCK_SIZE, HEAD_DIM,
                                                        kv_cache_dtype), kv_dtype.torch_dtype(kv_cache_dtype))
                          for h in self.local_heads]
        # [layers, K/V, blocks, heads, slot, dim]: numpy views of float32 caches, tensors otherwise
        self.caches = [c.buffer.numpy() if kv_cache_dtype == "float32" else c.buffer for c in self.kv_caches]
        self.workers = [WorkerConnector(self.config, num_kv_heads, r, tp_size, c.registration(), name,
                                        world.fabric.agent, threaded=False, clock=world.clock)
                        for r, c in enumerate(self.kv_caches)]
        fingerprint = Fingerprint(model, "float32", NUM_LAYERS, num_kv_heads, HEAD_DIM, BLOCK_SIZE,
                                  kv_cache_dtype=kv_cache_dtype)
        self.connector = SchedulerConnector(self.config, name, fingerprint,
                                            [w.rank_agent() for w in self.workers],
                                            network=world.network, clock=world.clock,
                                            caches=self.pool.cached.__contains__)
        self.blocks: dict[str, list[int]] = {}  # request id -> local blocks (what the engine would own)
        self.filled: dict[str, list[int]] = {}  # producer request id -> the blocks `prefill` filled
        self.outcomes: list[LoadOutcome] = []
        self.metadata: ConnectorMetadata | None = None  # for the ranks, with the next step
        self.pinned: list[Pinned] = []  # pinned for claims while applying an outcome, granted at once
        self.steps_with_metadata = 0  # steps that had to run the ranks to tell them something

    # --- the engine's part ------------------------------------------------------------------------

    def step(self, loads: list[RemoteLoad] = (), pulls: list[RemotePull] = ()) -> None:
        """What Engine.step does around the connector; `loads` and `pulls` are what its scheduler
        admitted in this step."""
        self.pool.release_quarantine(self.world.clock())
        meta, self.metadata = self.metadata, None
        self.steps_with_metadata += meta is not None
        for w in self.workers:
            if meta is not None:
                w.start_step(meta)
            w.run_once()
        outcome, self.metadata = self.connector.step(StepIn(list(loads), list(pulls),
                                                            [w.report() for w in self.workers]))
        self.apply(outcome)
        if self.pinned:
            self.metadata = self.connector.grant(self.pinned, self.metadata)
            self.pinned = []

    def apply(self, outcome: ConnectorOutcome) -> None:
        """What Engine._apply does, on the pool and the test's block table."""
        if outcome.free_blocks:
            self.pool.release(outcome.free_blocks)
        for until, blocks in outcome.quarantine:
            self.pool.quarantine_blocks(blocks, until)
        for o in outcome.loads:
            self.outcomes.append(o)
            if o.quarantine_blocks:  # only the blocks a READ wrote into, never shared ones
                self.pool.quarantine_blocks(list(o.quarantine_blocks), o.quarantine_until)
                self.blocks[o.request_id] = [b for b in self.blocks.get(o.request_id, [])
                                             if b not in o.quarantine_blocks]
            if o.state != TransferState.KV_LOADED:
                self.finish(o.request_id)
        for pin in outcome.pins:
            self.pinned.append(Pinned(pin.claim_id, self.pool.pin(pin.block_hashes, pin.spare)))

    def finish(self, request_id: str) -> None:
        """The request ends here (its blocks are freed, the connector hears of it)."""
        blocks = self.blocks.pop(request_id, [])
        if blocks:
            self.pool.release(blocks)
        self.connector.request_finished(request_id)

    def outcome(self, request_id: str) -> LoadOutcome | None:
        return next((o for o in self.outcomes if o.request_id == request_id), None)

    @property
    def num_free(self) -> int:
        return self.pool.num_free_blocks

    # --- producer ---------------------------------------------------------------------------------

    def prefill(self, request_id: str, num_tokens: int, seed: int = 1) -> dict:
        """Compute (fill) a prompt's blocks and hand them off; returns the params of the answer."""
        num_blocks = -(-(num_tokens + 1) // BLOCK_SIZE)  # the first token's slot, as the engine has
        blocks = self.pool.allocate(num_blocks)
        self.fill(blocks, seed)
        self.filled[request_id] = blocks
        handoff = self.connector.hand_off(request_id, list(range(num_tokens)), blocks, FirstToken(7),
                                          block_hashes(num_tokens))
        rest = [b for b in blocks if b not in handoff.block_ids]
        self.pool.release(rest)
        return handoff.params

    # --- consumer ---------------------------------------------------------------------------------

    def receive(self, request_id: str, params: dict) -> None:
        """add_request: the params are accepted (raises InvalidRequestError)."""
        self.connector.add_request(request_id, KVTransferParams.parse(params))

    def admit(self, request_id: str, num_tokens: int, cached: list[int] = ()) -> list[int]:
        """The scheduler gives the request its blocks (prompt + first token) in a step; `cached`: blocks
        this instance holds the prompt's first full blocks in (the engine takes them from its
        prefix cache; here the test fills them)."""
        self.pool.take(list(cached))  # one more owner each, as the scheduler takes prefix-cache hits
        blocks = list(cached) + self.pool.allocate(-(-(num_tokens + 1) // BLOCK_SIZE) - len(cached))
        self.blocks[request_id] = blocks
        self.step(loads=[RemoteLoad(request_id, blocks, len(cached))])  # the step that admitted it
        return blocks

    def fill(self, blocks: list[int], seed: int, first_position: int = 0) -> None:
        """Write the pattern a producer with `seed` would hold into local blocks."""
        for kv, heads in zip(self.kv_caches, self.local_heads):
            for i, b in enumerate(blocks):
                start = first_position + i * BLOCK_SIZE
                values = torch.from_numpy(pattern(seed, heads, range(start, start + BLOCK_SIZE)))
                if kv.scales is None:
                    kv.buffer[:, :, b] = values
                else:
                    kv.buffer[:, :, b], kv.scales[:, :, b] = kv_dtype.quantize(values)

    def kv(self, request_id: str, num_tokens: int) -> np.ndarray:
        """The request's KV as global heads: [layers, K/V, heads, tokens, dim]."""
        blocks = self.blocks[request_id]
        out = np.zeros((NUM_LAYERS, 2, self.num_kv_heads, len(blocks) * BLOCK_SIZE, HEAD_DIM), np.float32)
        for kv, heads in zip(self.kv_caches, self.local_heads):
            scales = None if kv.scales is None else kv.scales[:, :, blocks]
            data = kv_dtype.dequantize(kv.buffer[:, :, blocks], scales, torch.float32).numpy()
            data = data.transpose(0, 1, 3, 2, 4, 5).reshape(NUM_LAYERS, 2, len(heads), -1, HEAD_DIM)
            out[:, :, heads.start:heads.stop] = data
        return out[:, :, :, :num_tokens]

    def close(self) -> None:
        self.connector.close()
        for w in self.workers:
            w.close()


def pattern(seed: int, heads: range, positions: range) -> np.ndarray:
    """[layers, K/V, heads, positions, dim] values that name their place."""
    l, kv, h, p, d = np.meshgrid(np.arange(NUM_LAYERS), np.arange(2), np.array(heads), np.array(positions),
                                 np.arange(HEAD_DIM), indexing="ij")
    return (seed * 1e6 + l * 1e5 + kv * 1e4 + h * 1e3 + p * 10 + d).astype(np.float32)


def block_hashes(num_tokens: int, keys: tuple[str, ...] = ("m",)) -> tuple[str, ...]:
    """The content hashes of a harness prompt's full blocks (its tokens are 0, 1, 2, ...)."""
    return tuple(wire_hash(h) for h in hash_blocks(list(range(num_tokens)), BLOCK_SIZE, keys))


def expected_kv(seed: int, num_kv_heads: int, num_tokens: int) -> np.ndarray:
    return pattern(seed, range(num_kv_heads), range(num_tokens))


def _registered(cache: np.ndarray) -> RegisteredCache:
    num_blocks, heads = cache.shape[2], cache.shape[3]
    head_bytes = BLOCK_SIZE * HEAD_DIM * cache.itemsize
    block_bytes = heads * head_bytes
    base = cache.ctypes.data
    regions = tuple(base + i * num_blocks * block_bytes for i in range(NUM_LAYERS * 2))
    return RegisteredCache(base, cache.nbytes, "cpu",
                           RegionTable(regions, block_bytes, head_bytes, heads, num_blocks))


@dataclasses.dataclass
class World:
    """One fabric, one side-channel network, one clock: what a test's instances share."""

    clock: Clock = dataclasses.field(default_factory=Clock)
    fabric: LoopbackFabric = None
    network: LoopbackNetwork = None
    instances: list[Instance] = dataclasses.field(default_factory=list)

    def __post_init__(self):
        self.fabric = self.fabric or LoopbackFabric(self.clock)
        self.network = self.network or LoopbackNetwork(self.clock)

    def instance(self, name: str, tp_size: int = 1, **kw) -> Instance:
        inst = Instance(name, tp_size, self, **kw)
        self.instances.append(inst)
        return inst

    def run(self, steps: int = 6, advance_s: float = 0.0) -> None:
        """Steps of every instance, side-channel replies delivered in between."""
        for _ in range(steps):
            self.network.pump()
            for inst in self.instances:
                inst.step()
            self.clock.advance(advance_s)

    def close(self) -> None:
        for inst in self.instances:
            inst.close()
