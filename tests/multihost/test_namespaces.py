"""P/D across hosts, as a user has them: a producer, a TP-2 decoder and the proxy each in its own
network namespace with its own address, every one binding and advertising that address (IPv4, then
IPv6). Answers equal a colocated instance's; the handshake goes to the advertised address; the
UCX transport that carried the READs and their speed are recorded."""

from __future__ import annotations

import os
import random
import re

import pytest

from helpers import assert_greedy_match, hf_reference
from netns import Hosts, can_make_namespaces
from pdserve.launcher import Instance
from servers import get_json, metric, post_json, wait_idle

SECRET = {"PDSERVE_KV_SECRET": "namespaces-" + os.urandom(6).hex()}
COMMON = ["--port", "0", "--num-blocks", "256", "--num-threads", "1", "--enable-debug-endpoints",
          "--kv-handshake-timeout-s", "10"]


@pytest.fixture(scope="module")
def hosts():
    why = can_make_namespaces()
    if why:
        pytest.skip(f"network namespaces: {why}")
    with Hosts(["prefill", "decode", "proxy"]) as h:
        yield h


def start(hosts: Hosts, host: str, role: str, args: list[str], address: str, log_dir, env=None) -> Instance:
    inst = Instance(role, args, host=address, prefix=hosts.exec_prefix(host))
    return inst.spawn(log_dir, {**SECRET, **(env or {})}).wait_healthy(120)


def deployment(hosts: Hosts, model: str, family: str, log_dir):
    addr = hosts.ipv4 if family == "ipv4" else hosts.ipv6
    p, d, x = addr("prefill"), addr("decode"), addr("proxy")
    started = []
    try:
        started.append(start(hosts, "prefill", f"prefill-{family}", [
            "serve", model, *COMMON, "--host", p, "--side-channel-host", p, "--advertised-host", p], p, log_dir))
        started.append(start(hosts, "decode", f"decode-{family}", [
            "serve", model, *COMMON, "--host", d, "--side-channel-host", d, "--tensor-parallel-size", "2"], d,
            log_dir, env={"UCX_PROTO_INFO": "y"}))
        started.append(start(hosts, "proxy", f"proxy-{family}", [
            "proxy", "--port", "0", "--host", x, "--prefill", started[0].url, "--decode", started[1].url], x, log_dir))
    except BaseException:
        for inst in started:
            inst.stop()
        raise
    return started


def read_transport(log: str) -> str | None:
    """The transport UCX chose for READs: `UCX_PROTO_INFO=y` prints a table per protocol selection,
    whose rows end with the transport ("cma/memory", "tcp/eth0", ...)."""
    lines = log.splitlines()
    for i, line in enumerate(lines):
        if "remote memory read by ucp_get" in line:
            for row in lines[i + 1:i + 8]:
                m = re.search(r"\|\s*\d+\.\.\S+\s*\|[^|]*\|\s*([\w/.]+)\s*\|\s*$", row)
                if m:
                    return m.group(1)
    return None


@pytest.mark.parametrize("family", ["ipv4", "ipv6"])
def test_pd_across_namespaces(hosts, tiny_model, tmp_path, family):
    prefill, decode, proxy = deployment(hosts, tiny_model, family, tmp_path)
    try:
        rng = random.Random(7)
        for n in (5, 40, 300):
            ids = [1] + [rng.randrange(7, 1000) for _ in range(n - 1)]
            code, body = post_json(proxy.url + "/v1/completions",
                                   {"prompt": ids, "max_tokens": 12, "temperature": 0, "return_token_ids": True})
            assert code == 200, body
            assert_greedy_match(body["choices"][0]["token_ids"], hf_reference(tiny_model, ids, 12), family)
        # the producer advertises its own address, and decode dialed exactly that
        code, answer = post_json(prefill.url + "/v1/completions", {
            "prompt": [1, 8, 9], "max_tokens": 2, "kv_transfer_params": {"do_remote_decode": True}})
        assert answer["kv_transfer_params"]["remote_host"] == prefill.host
        assert metric(decode, "pdserve:nixl_handshakes_total") == 1
        assert metric(decode, "pdserve:kv_transfers_total") >= 3
        seconds = metric(decode, "pdserve:nixl_xfer_time_seconds_sum")
        gbps = metric(decode, "pdserve:nixl_bytes_transferred_sum") / seconds / 1e9
        transport = read_transport(decode.log_path.read_text())
        print(f"\n{family}: READs over {transport} at {gbps:.3f} GB/s (small READs: mostly overhead)")
        assert transport and transport.startswith("cma")  # another host by address, the same machine
        assert get_json(decode.url + "/health")["warnings"] == []  # same host: shared memory was available
        post_json(prefill.url + "/kv/release", {"kv_transfer_params": answer["kv_transfer_params"]})
        for inst in (prefill, decode):
            s = wait_idle(inst)
            assert s["num_free_blocks"] == s["num_blocks"]
    finally:
        for inst in (proxy, decode, prefill):
            inst.stop()
