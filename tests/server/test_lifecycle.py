"""Start-up and shutdown: /health while starting, busy or broken, overload, SIGTERM with TP ranks, a
dead engine ending the process."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import threading
import time
import urllib.request

import httpx
import pytest

from servers import post_json, start_server


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def test_sigterm_finishes_in_flight_and_leaves_no_process(tiny_model, tmp_path):
    inst = start_server(tiny_model, tmp_path, "--shutdown-timeout-s", "20", tp=2, num_blocks=64)
    pgid = inst.proc.pid
    ranks = [int(p) for p in os.listdir("/proc") if p.isdigit() and _pgid(int(p)) == pgid]
    assert len(ranks) >= 2  # the server and its spawned TP rank (plus spawn helpers)
    result = {}

    def in_flight():
        result["r"] = post_json(inst.url + "/v1/completions",
                                {"prompt": "finish me", "max_tokens": 40, "ignore_eos": True}, timeout=60)
    t = threading.Thread(target=in_flight)
    t.start()
    time.sleep(0.3)
    os.kill(inst.proc.pid, signal.SIGTERM)
    t.join(60)
    inst.proc.wait(60)
    code, body = result["r"]
    assert code == 200 and body["usage"]["completion_tokens"] == 40  # finished, not cut
    deadline = time.monotonic() + 10
    while _group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _group_alive(pgid), "TP rank processes outlived the server"


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def test_health_is_503_when_the_engine_cannot_start(tiny_model, tmp_path):
    bad = tmp_path / "bad-model"
    shutil.copytree(tiny_model, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["architectures"] = ["NoSuchForCausalLM"]
    (bad / "config.json").write_text(json.dumps(cfg))
    inst = start_server(str(bad), tmp_path, wait=False)
    try:
        deadline = time.monotonic() + 60
        while _port(inst) is None:
            assert time.monotonic() < deadline, "the server never bound its port"
            time.sleep(0.1)
        while True:
            try:
                urllib.request.urlopen(inst.url + "/health", timeout=5)
            except urllib.error.HTTPError as e:
                body = json.loads(e.read())
                assert e.code == 503
                if "failed" in body["error"]["message"]:
                    assert "NoSuchForCausalLM" in body["error"]["message"]
                    break
            except (urllib.error.URLError, ConnectionError):
                pass
            assert time.monotonic() < deadline, "no 503 naming the failure"
            time.sleep(0.2)
        code, resp = post_json(inst.url + "/v1/completions", {"prompt": "x"})
        assert code == 503 and "NoSuchForCausalLM" in resp["error"]["message"]
    finally:
        inst.stop()


def _port(inst) -> int | None:
    if inst.port is None and inst.port_file.exists():
        inst.port = json.loads(inst.port_file.read_text())["port"]
    return inst.port


def test_overload_is_503(tiny_model, tmp_path):
    inst = start_server(tiny_model, tmp_path, "--max-pending", "1", num_blocks=64)
    try:
        with httpx.Client(timeout=30) as h:
            with h.stream("POST", inst.url + "/v1/completions",
                          json={"prompt": "long one", "max_tokens": 1000, "ignore_eos": True,
                                "stream": True}) as r:
                lines = r.iter_lines()  # keep a reference: a collected iterator closes the stream
                next(lines)  # in flight: 1000 tokens take far longer than one request
                code, resp = post_json(inst.url + "/v1/completions", {"prompt": "x", "max_tokens": 1})
                assert sum(1 for line in lines if line.startswith("data: {")) > 100  # still ran
        assert code == 503 and resp["error"]["type"] == "ServiceUnavailableError", resp
        deadline = time.monotonic() + 10
        while post_json(inst.url + "/v1/completions", {"prompt": "x", "max_tokens": 1})[0] != 200:
            assert time.monotonic() < deadline
            time.sleep(0.1)
    finally:
        inst.stop()


def _rank_process(server_pid: int) -> int:
    """The spawned TP rank child of a server (not multiprocessing's resource tracker)."""
    for p in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{p}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{p}/cmdline", "rb") as f:
                cmdline = f.read()
        except (FileNotFoundError, ProcessLookupError, ValueError, IndexError):
            continue
        if ppid == server_pid and b"spawn_main" in cmdline:
            return int(p)
    raise AssertionError("no TP rank process found")


@pytest.mark.parametrize("when", ["idle", "streaming"])
def test_an_instance_whose_tp_rank_dies_exits_with_an_error(tiny_model, tmp_path, when):
    """Nothing restarts an instance that stays up with a dead engine: it exits non-zero, soon,
    after failing what was in flight, and its log says why."""
    inst = start_server(tiny_model, tmp_path, tp=2, num_blocks=64)
    try:
        rank = _rank_process(inst.proc.pid)
        if when == "idle":
            os.kill(rank, signal.SIGKILL)
            killed = time.monotonic()
        else:
            with httpx.Client(timeout=30) as h, \
                    h.stream("POST", inst.url + "/v1/completions",
                             json={"prompt": "long one", "max_tokens": 1000, "ignore_eos": True,
                                   "stream": True}) as r:
                lines = r.iter_lines()
                next(lines)
                os.kill(rank, signal.SIGKILL)
                killed = time.monotonic()
                events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
            assert "error" in events[-1], events[-1]
        try:
            code = inst.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pytest.fail("the server still runs 10 s after its TP rank died")
        assert code != 0 and time.monotonic() - killed < 10
        assert "TP rank 1" in inst.log_path.read_text()
    finally:
        inst.stop()


def test_health_answers_at_once_while_a_long_step_runs(tiny_model, tmp_path):
    """A step longer than a router's probe timeout does not make a busy instance look down."""
    inst = start_server(tiny_model, tmp_path, num_blocks=64)
    try:
        assert post_json(inst.url + "/debug/step_delay", {"seconds": 1.5})[0] == 200
        t = threading.Thread(target=post_json, daemon=True, args=(
            inst.url + "/v1/completions", {"prompt": "x", "max_tokens": 2, "ignore_eos": True}))
        t.start()
        slowest, saw_request = 0.0, False
        deadline = time.monotonic() + 2.5  # within the request's two 1.5 s steps
        with httpx.Client(timeout=10) as h:
            while time.monotonic() < deadline:
                began = time.monotonic()
                r = h.get(inst.url + "/health")
                slowest = max(slowest, time.monotonic() - began)
                assert r.status_code == 200, r.text
                load = r.json()["load"]
                saw_request = saw_request or load["num_running"] + load["num_waiting"] > 0
                time.sleep(0.05)
        t.join(30)
        assert saw_request, "no /health answer showed the request in the engine"
        assert slowest < 0.5, f"/health took {slowest:.2f} s while a step ran"
    finally:
        inst.stop()
