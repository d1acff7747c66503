"""The Ray driver's reconcile loop on a fake Ray: departures stop in the background while the loop
goes on, and a proxy that dies is started again on its port and told the routes."""

from __future__ import annotations

import json
import time
import types

import httpx

from fake_ray import FakeRay, Stops
from pdserve.cluster.actors import InstanceActor, Registry
from pdserve.cluster.driver import RayDeployment


def _args(prefill: int, decode: int, log_dir: str | None = None) -> types.SimpleNamespace:
    return types.SimpleNamespace(
        ray=None, prefill=prefill, decode=decode, port=0, host="127.0.0.1", proxy_args="",
        log_dir=log_dir, prefill_tp=1, decode_tp=1, ray_threads_per_rank=1, instance_args="",
        prefill_args="", decode_args="", prefill_resources=None, decode_resources=None)


class _Proc:
    def poll(self):
        return None


class _FakeProxy:
    url = "http://proxy.test"
    proc = _Proc()

    def stop(self) -> None:
        pass


def _on_fakes(stops: Stops, prefill: int, decode: int):
    """A driver whose Ray, registry and proxy are fakes; returns it and the routes PUT to the proxy."""
    ray = FakeRay({InstanceActor: stops.instance_actor()})
    puts: list[dict] = []

    def proxy(request: httpx.Request) -> httpx.Response:
        puts.append(json.loads(request.content))
        return httpx.Response(200, json={})
    dep = RayDeployment(_args(prefill, decode), "model", ray=ray,
                        http=httpx.Client(transport=httpx.MockTransport(proxy)))
    dep.registry = ray.remote(Registry).remote(prefill, decode)
    dep.proxy = _FakeProxy()
    return dep, puts


def _wait(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_reconcile_goes_on_while_departing_instances_stop():
    stops = Stops(max_s=5.0)
    dep, puts = _on_fakes(stops, prefill=0, decode=3)
    try:
        dep.reconcile(wait_s=0.05)
        assert len(puts[-1]["decode"]) == 3
        handles = {m.info["url"]: m.actor for m in dep.members}

        dep.ray.get(dep.registry.scale.remote(decode=1))
        began = time.monotonic()
        dep.reconcile(wait_s=0.05)
        assert time.monotonic() - began < 1.0, "the loop waited for instances to stop"
        assert len(puts[-1]["decode"]) == 1  # the departing ones left the proxy first
        _wait(lambda: len(stops.begun) == 2, 2.0, "the two departing instances did not stop at once")

        dep.ray.get(dep.registry.scale.remote(decode=2))  # while both still finish their streams
        dep.reconcile(wait_s=0.05)
        assert len(puts[-1]["decode"]) == 2
        assert not any(handles[url].killed for url in stops.begun)  # still stopping gracefully
        handles.update({m.info["url"]: m.actor for m in dep.members})
    finally:
        stops.release.set()
        dep.stop()
    assert all(h.killed for h in handles.values())  # the driver's stop waited for every one


def test_a_proxy_that_dies_comes_back_on_its_port_with_the_routes(tmp_path):
    stops = Stops()
    stops.release.set()
    ray = FakeRay({InstanceActor: stops.instance_actor()})
    dep = RayDeployment(_args(prefill=1, decode=1, log_dir=str(tmp_path)), "model", ray=ray)
    try:
        dep.start(timeout_s=60)
        url = dep.proxy.url
        instances = {role: [m.info["url"] for m in dep.members if m.role == role]
                     for role in ("prefill", "decode")}
        assert _proxy_members(url) == instances

        dep.proxy.kill()
        deadline = time.monotonic() + 20
        while _proxy_members(url) != instances:
            assert time.monotonic() < deadline, "the proxy was not started again with the routes"
            dep.reconcile(wait_s=0.1)
        assert dep.proxy.url == url
    finally:
        dep.stop()


def _proxy_members(url: str) -> dict | None:
    """The instances a proxy routes to, as its /health lists them (None if it does not answer)."""
    try:
        body = httpx.get(url + "/health", timeout=5).json()
    except httpx.HTTPError:
        return None
    return {role: sorted(body[role]) for role in ("prefill", "decode")}
