"""pdserve's version as `GET /version` reports it (vLLM's route), on instances and the proxy alike."""

from __future__ import annotations

import importlib.metadata


def version() -> str:
    try:
        return importlib.metadata.version("pdserve")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that is not installed
        return "unknown"
