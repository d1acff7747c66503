"""Configuration a deployment gets right by default: no side channel off loopback without a secret
(unless told, loudly), `pdserve up` signs, and the API key covers /metrics and /debug."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from pdserve.config import ConfigError, KVTransferConfig
from pdserve.launcher import Deployment
from servers import start_server


def test_a_side_channel_off_loopback_needs_a_secret():
    for host in ("127.0.0.1", "::1", "localhost"):
        KVTransferConfig(side_channel_host=host)
    with pytest.raises(ConfigError, match="side_channel_host.*no shared secret"):
        KVTransferConfig(side_channel_host="0.0.0.0", advertised_host="10.0.0.1")
    KVTransferConfig(side_channel_host="0.0.0.0", advertised_host="10.0.0.1", secret=b"s")
    KVTransferConfig(side_channel_host="0.0.0.0", advertised_host="10.0.0.1", allow_insecure=True)


def test_serve_refuses_to_start_and_says_why(tiny_model):
    r = subprocess.run([sys.executable, "-m", "pdserve.cli", "serve", tiny_model, "--port", "0",
                        "--side-channel-host", "0.0.0.0", "--advertised-host", "127.0.0.1"],
                       capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin"})
    assert r.returncode != 0 and "PDSERVE_KV_SECRET" in r.stderr, r.stderr[-2000:]


def test_pdserve_up_generates_a_secret(tiny_model, tmp_path, monkeypatch):
    monkeypatch.delenv("PDSERVE_KV_SECRET", raising=False)
    a, b = (Deployment(tiny_model, [1], [1], log_dir=str(tmp_path)) for _ in range(2))
    assert len(a.env["PDSERVE_KV_SECRET"]) == 64 and a.env["PDSERVE_KV_SECRET"] != b.env["PDSERVE_KV_SECRET"]


def test_the_api_key_covers_metrics_and_debug(tiny_model, tmp_path):
    inst = start_server(tiny_model, tmp_path, "--api-key", "k3y", role="keyed")
    try:
        with httpx.Client(timeout=10) as h:
            assert h.get(inst.url + "/health").status_code == 200
            for path in ("/metrics", "/debug/stats", "/v1/models"):
                r = h.get(inst.url + path)
                assert r.status_code == 401 and r.json()["error"]["type"] == "AuthenticationError", path
                assert h.get(inst.url + path, headers={"Authorization": "Bearer k3y"}).status_code == 200
            r = h.get(inst.url + "/no/such/route", headers={"Authorization": "Bearer k3y"})
            assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError"
    finally:
        inst.stop()
