"""P/D deployments (prefill + decode + proxy processes, real NIXL), started once per module."""

from __future__ import annotations

import pytest

from pdserve.launcher import Deployment

INSTANCE_ARGS = ["--num-blocks", "256", "--enable-debug-endpoints", "--kv-handshake-timeout-s", "5"]


def start_deployment(model: str, p_tp: int, d_tp: int, log_dir, extra: list[str] = ()) -> Deployment:
    dep = Deployment(model, [p_tp], [d_tp], instance_args=[*INSTANCE_ARGS, *extra],
                     log_dir=str(log_dir))
    return dep.start(timeout_s=120)
