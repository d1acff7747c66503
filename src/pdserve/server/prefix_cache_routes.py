"""Routes about the prefix cache: vLLM's `POST /reset_prefix_cache`, and `GET /kv/events/snapshot`
(every cached block, consistent with a KV events sequence number) for a subscriber that lost events.

Server process. Both run on the engine thread between steps; both are behind the API key.
"""

from __future__ import annotations

import msgspec
from fastapi import FastAPI
from fastapi.responses import Response

from pdserve.http.errors import APIError
from pdserve.server.async_engine import AsyncEngine


def add_prefix_cache_routes(app: FastAPI, engine: AsyncEngine) -> None:
    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache():
        """Forget every cached block (blocks in use stay with their requests, uncached); subscribers
        get AllBlocksCleared."""
        _require_ready(engine)
        return {"num_blocks_cleared": await engine.call(lambda e: e.reset_prefix_cache())}

    @app.get("/kv/events/snapshot")
    async def kv_events_snapshot():
        _require_ready(engine)
        snapshot = await engine.call(lambda e: e.kv_events.snapshot())
        if snapshot is None:
            raise APIError(404, "KV events are off on this instance (see --kv-events-config)",
                           "NotFoundError")
        return Response(msgspec.json.encode(snapshot), media_type="application/json")


def _require_ready(engine: AsyncEngine) -> None:
    if not engine.is_ready:
        raise APIError(503, "engine is " + (f"down: {engine.error}" if engine.error else "starting"))
