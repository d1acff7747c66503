"""Test-only routes (`--enable-debug-endpoints`): engine counters and KV cache hooks on every rank.

Server process. Never enabled by `pdserve up` unless asked; they let tests prove that decode used
the transferred KV (perturb or checksum blocks), count the remote agents each rank loaded, and make
model steps slow.
"""

from __future__ import annotations

from fastapi import FastAPI
from pydantic import BaseModel, Field

from pdserve.prefix_cache.hashing import event_hash
from pdserve.server.async_engine import AsyncEngine


class BlocksBody(BaseModel):
    block_ids: list[int]
    delta: float = 0.0


class DelayBody(BaseModel):
    seconds: float = Field(ge=0)


def add_debug_routes(app: FastAPI, engine: AsyncEngine) -> None:
    @app.get("/debug/stats")
    async def stats():
        return await engine.call(lambda e: {**e.stats(), "engine_id": e.engine_id,
                                            "max_model_len": e.max_model_len})

    @app.post("/debug/kv_checksum")
    async def kv_checksum(body: BlocksBody):
        results = await engine.call(lambda e: e.executor.debug("checksum", body.block_ids))
        return {"checksums": [r.value for r in results]}

    @app.post("/debug/kv_perturb")
    async def kv_perturb(body: BlocksBody):
        await engine.call(lambda e: e.executor.debug("perturb", body.block_ids, body.delta))
        return {"ok": True}

    @app.post("/debug/step_delay")
    async def step_delay(body: DelayBody):
        """Every model step from now on takes `seconds` longer on every rank (0: as before)."""
        await engine.call(lambda e: e.executor.debug("step_delay", body.seconds))
        return {"ok": True}

    @app.get("/debug/kv_cached_hashes")
    async def kv_cached_hashes():
        """The hashes (64-bit event form) the prefix cache holds now, read from the pool itself."""
        return {"block_hashes": await engine.call(lambda e: sorted(map(event_hash, e.pool.cached)))}

    @app.get("/debug/gc_frozen")
    async def gc_frozen():
        results = await engine.call(lambda e: e.executor.debug("gc_frozen"))
        return {"ranks": [r.value for r in results]}

    @app.get("/debug/loaded_peers")
    async def loaded_peers():
        results = await engine.call(lambda e: e.executor.debug("loaded_peers"))
        return {"ranks": [r.value for r in results]}
