"""P/D on a two-node Ray cluster, the nodes being network namespaces with their own addresses.

`pdserve up --ray` places the producer on one node and the decoder on the other (custom resources),
answers as a colocated instance would, scales decode up under load without a failed request, and
when a decode instance is killed under load Ray restarts it and the proxy routes to it again; the
requests in flight on it fail cleanly (an error, never a wrong answer) and nothing leaks.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import random
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from helpers import assert_greedy_match, hf_reference
from netns import Hosts, can_make_namespaces
from pdserve.launcher import Instance
from raycluster import RayCluster, ray_env
from servers import metric, post_json, wait_idle

pytest.importorskip("ray", reason="the Ray deployment needs `pip install 'pdserve[ray]'`")

ENV = ray_env(PDSERVE_KV_SECRET="ray-" + os.urandom(6).hex())
# short leases and transfer timeouts: a dead reader's blocks come back (expiry + quarantine) within ~15 s
INSTANCE_ARGS = ("--num-blocks 256 --enable-debug-endpoints --kv-handshake-timeout-s 10 --kv-lease-s 5 "
                 "--kv-transfer-timeout-s 5")


@pytest.fixture(scope="module")
def cluster():
    """A head node (resource node_a) and a worker node (node_b), 2 logical CPUs each."""
    why = can_make_namespaces()
    if why:
        pytest.skip(f"network namespaces: {why}")
    with Hosts(["head", "worker"], subnet=78) as hosts, \
            RayCluster(hosts, [("head", {"node_a": 1}), ("worker", {"node_b": 1})], env=ENV) as ray:
        yield hosts, ray.address


@pytest.fixture(scope="module")
def deployment(cluster, tiny_model, tmp_path_factory):
    hosts, address = cluster
    head = hosts.ipv4("head")
    driver = Instance("ray-driver", ["up", tiny_model, "--ray", address, "--port", "0", "--host", head,
                                     "--prefill-resources", '{"node_a": 0.5}', "--decode-resources", '{"node_b": 0.5}',
                                     "--instance-args", INSTANCE_ARGS], host=head, prefix=hosts.exec_prefix("head"))
    driver.spawn(tmp_path_factory.mktemp("ray"), ENV)
    try:
        driver.wait_healthy(300)
        yield hosts, address, driver
    finally:
        driver.stop(60)


def ray_cli(hosts: Hosts, address: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(hosts.exec_prefix("head") + [sys.executable, "-m", "pdserve.cli", "ray", *args,
                                                        "--address", address],
                          env=ENV, capture_output=True, text=True, timeout=timeout)


def status(hosts: Hosts, address: str) -> dict:
    r = ray_cli(hosts, address, "status", "--json", timeout=60)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def instance(s: dict, role: str, n: int = 0) -> Instance:
    """The n-th serving `role` instance of a status, as something servers.py's helpers can ask."""
    info = [i for i in s["instances"] if i["role"] == role and i.get("alive")][n]
    host, port = info["url"].removeprefix("http://").rsplit(":", 1)
    return Instance(role, [], host=host, port=int(port))


def test_instances_on_their_nodes_answer_like_one_instance(deployment, tiny_model):
    hosts, address, proxy = deployment
    s = status(hosts, address)
    assert s["ready"] == {"prefill": 1, "decode": 1}
    where = {i["role"]: i["host"] for i in s["instances"]}
    assert where == {"prefill": hosts.ipv4("head"), "decode": hosts.ipv4("worker")}
    rng = random.Random(3)
    for n in (6, 70):
        ids = [1] + [rng.randrange(7, 1000) for _ in range(n - 1)]
        code, body = post_json(proxy.url + "/v1/completions",
                               {"prompt": ids, "max_tokens": 10, "temperature": 0, "return_token_ids": True})
        assert code == 200, body
        assert_greedy_match(body["choices"][0]["token_ids"], hf_reference(tiny_model, ids, 10), "ray")
    decode = instance(s, "decode")
    assert metric(decode, "pdserve:kv_transfers_total") >= 2  # the KV crossed from node to node
    # each instance publishes its KV events on its node's address; the proxy's index follows both
    deadline, indexed = time.monotonic() + 10, {}
    while time.monotonic() < deadline and not (len(indexed) == 2 and all(indexed.values())):
        time.sleep(0.2)
        with urllib.request.urlopen(proxy.url + "/kv/index", timeout=10) as r:
            indexed = json.loads(r.read())["instances"]
    assert sorted(indexed) == sorted(i["url"] for i in s["instances"]) and all(indexed.values()), indexed


class Load:
    """Requests through the proxy, two at a time, until stopped; each answer is checked against the
    reference (a 200 with other tokens would be silent corruption)."""

    def __init__(self, url: str, model: str, n_prompts: int = 4):
        rng = random.Random(11)
        self.url = url
        self.prompts = [[1] + [rng.randrange(7, 1000) for _ in range(rng.randrange(8, 90))] for _ in range(n_prompts)]
        self.reference = [hf_reference(model, ids, 8) for ids in self.prompts]
        self.codes: list[int] = []
        self.wrong: list[str] = []
        self.errors: list[str | None] = []
        self.stopped = False
        self.pool = concurrent.futures.ThreadPoolExecutor(2)

    def _one(self, k: int) -> None:
        while not self.stopped:
            i = k % len(self.prompts)
            k += 1
            try:
                code, body = post_json(self.url + "/v1/completions", {
                    "prompt": self.prompts[i], "max_tokens": 8, "temperature": 0, "return_token_ids": True},
                    timeout=60)
            except OSError:
                code, body = 0, None
            self.codes.append(code)
            if code not in (0, 200):  # an error says what happened, in OpenAI's shape
                self.errors.append(((body or {}).get("error") or {}).get("message"))
            if code == 200:
                try:
                    assert_greedy_match(body["choices"][0]["token_ids"], self.reference[i], "ray load")
                except AssertionError as e:
                    self.wrong.append(str(e))

    def __enter__(self) -> "Load":
        self.futures = [self.pool.submit(self._one, k) for k in range(2)]
        return self

    def __exit__(self, *exc) -> None:
        self.stopped = True
        for f in self.futures:
            f.result(timeout=120)
        self.pool.shutdown()

    def served(self) -> int:
        return sum(1 for c in self.codes if c == 200)


def test_decode_scales_up_and_down_under_load(deployment, tiny_model):
    hosts, address, proxy = deployment
    with Load(proxy.url, tiny_model) as load:
        time.sleep(2)
        r = ray_cli(hosts, address, "scale", "--decode", "2")
        assert r.returncode == 0, r.stdout + r.stderr
        assert json.loads(r.stdout.splitlines()[-1])["ready"] == {"prefill": 1, "decode": 2}
        s = status(hosts, address)
        new = instance(s, "decode", 1)
        deadline = time.monotonic() + 60
        while metric(new, "pdserve:kv_transfers_total") < 2:  # the proxy routes to it too
            assert time.monotonic() < deadline, "the new decode instance got no requests"
            time.sleep(0.5)
        r = ray_cli(hosts, address, "scale", "--decode", "1")
        assert r.returncode == 0, r.stdout + r.stderr
        time.sleep(2)
    assert load.wrong == []
    assert set(load.codes) == {200}, sorted(set(load.codes))  # scaling lost no request
    s = status(hosts, address)
    assert s["ready"] == {"prefill": 1, "decode": 1} and len(s["instances"]) == 2
    for role in ("prefill", "decode"):
        idle = wait_idle(instance(s, role))
        assert idle["num_free_blocks"] == idle["num_blocks"], role


@pytest.mark.parametrize("victim", ["instance", "actor"])
def test_a_killed_decode_instance_comes_back(deployment, tiny_model, victim):
    """SIGKILL of the instance (its process group: every rank at once), or of its actor's worker
    (the instance follows it: PR_SET_PDEATHSIG); either way Ray restarts the actor."""
    hosts, address, proxy = deployment
    s = status(hosts, address)
    before = instance(s, "decode")
    info = next(i for i in s["instances"] if i["role"] == "decode")
    with Load(proxy.url, tiny_model) as load:
        time.sleep(2)
        if victim == "instance":
            os.killpg(info["serve_pid"], signal.SIGKILL)
        else:
            os.kill(info["actor_pid"], signal.SIGKILL)
        killed_at = len(load.codes)
        deadline = time.monotonic() + 180
        while True:  # Ray restarts the actor, which starts a new instance; the driver routes to it
            s = status(hosts, address)
            if s["ready"]["decode"] == 1 and instance(s, "decode").url != before.url:
                break
            assert time.monotonic() < deadline, s
            time.sleep(1)
        back = len(load.codes)
        deadline = time.monotonic() + 60
        while load.codes[back:].count(200) < 6:
            assert time.monotonic() < deadline, load.codes[back:]
            time.sleep(0.5)
    assert load.wrong == []  # an answer is right or it is an error
    assert set(load.codes[:killed_at]) == {200}
    assert set(load.codes) <= {200, 502, 503}, sorted(set(load.codes))  # failed cleanly, none hung
    assert all(load.errors), load.errors
    assert load.codes[-4:] == [200] * 4, load.codes[back:]
    s = status(hosts, address)
    assert metric(instance(s, "decode"), "pdserve:kv_transfers_total") >= 4  # P/D again, on the new one
    idle = wait_idle(instance(s, "prefill"), timeout_s=45)  # the dead reader's leases expire, quarantine ends
    assert idle["num_free_blocks"] == idle["num_blocks"]


def test_status_and_refusals(deployment, tiny_model):
    hosts, address, _ = deployment
    r = ray_cli(hosts, address, "scale", "--decode", "0", timeout=60)
    assert r.returncode != 0 and "decode: must be >= 1" in r.stderr, r.stderr
    r = subprocess.run(hosts.exec_prefix("head") + [sys.executable, "-m", "pdserve.cli", "up", tiny_model,
                                                     "--ray", address, "--port", "0"],
                       env=ENV, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "already runs on this Ray cluster" in r.stderr, r.stderr[-2000:]
    assert status(hosts, address)["ready"] == {"prefill": 1, "decode": 1}  # the first one is untouched
    table = ray_cli(hosts, address, "status", timeout=60).stdout.splitlines()  # as a person reads it
    assert table[0].startswith("proxy http://") and len(table) == 3, table
    assert {line.split()[0] for line in table[1:]} == {"prefill", "decode"}
    assert all(line.split()[-1] == "serving" and hosts.ipv4("worker" if line.startswith("decode") else "head")
               in line for line in table[1:]), table
