"""`pdserve up --ray`, `pdserve ray scale`, `pdserve ray status`.

CLI process: a Ray driver on a node of the cluster. Ray places the instances (actors, see
actors.py) by the CPUs and custom resources each asks for, and restarts them when they die; the
driver runs the proxy beside it and, about once a second, asks every actor how it is and tells the
proxy which instances answer (`PUT /admin/upstreams`), so instances that join, leave, die or come
back are routed to without restarting anything. Instances that leave stop in the background, and a
proxy that dies is started again on its port and told the routes. The driver owns the actors: when
it stops, they stop.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import os
import secrets
import shlex
import socket
import tempfile
import time
from pathlib import Path

import httpx

from pdserve.cluster import plan
from pdserve.cluster.actors import NAMESPACE, REGISTRY, InstanceActor, Registry
from pdserve.launcher import Instance, chat_template_args, foreground, role_defaults

logger = logging.getLogger("pdserve.cluster")


def connect(address: str | None):
    """`ray.init` as a driver of the cluster at `address` (None: RAY_ADDRESS, else the local one)."""
    try:
        import ray
    except ImportError:
        raise SystemExit("a Ray deployment needs Ray: pip install 'pdserve[ray]'") from None
    address = address or os.environ.get("RAY_ADDRESS") or "auto"
    extra = {}
    if address != "auto":  # this node is whichever of its addresses reaches the head
        extra["_node_ip_address"] = local_address_towards(address)
    ray.init(address=address, namespace=NAMESPACE, log_to_driver=False, **extra)
    return ray


def _resources(text: str | None, flag: str) -> dict:
    """Ray custom resources from JSON: {"name": amount, ...}."""
    try:
        value = json.loads(text or "{}")
    except json.JSONDecodeError as e:
        raise SystemExit(f"{flag}: not JSON: {e}") from None
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, (int, float)) and v >= 0
                                              for k, v in value.items()):
        raise SystemExit(f'{flag}: must be an object of resource amounts, e.g. {{"node_a": 1}}; got {text!r}')
    return value


def _check_counts(args, command: str) -> None:
    try:
        plan.check_counts(args.prefill, args.decode)
    except ValueError as e:
        raise SystemExit(f"{command}: --{e}") from None


def local_address_towards(address: str) -> str:
    """This host's address on the route to `host:port` (a UDP connect sends nothing)."""
    host = address.removeprefix("ray://").rsplit(":", 1)[0].strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))
        return s.getsockname()[0]


class RayDeployment:
    def __init__(self, args, model: str, ray=None, http: httpx.Client | None = None):
        """`ray` and `http` are seams for tests (a fake Ray; the client that talks to the proxy)."""
        self.args = args
        self.model = model
        self.env = {"PDSERVE_KV_SECRET": os.environ.get("PDSERVE_KV_SECRET") or secrets.token_hex(32)}
        self.admin_key = secrets.token_hex(16)
        self.members: list[plan.Member] = []
        self.resources = {role: _resources(getattr(args, f"{role}_resources"), f"--{role}-resources")
                          for role in plan.ROLES}
        self.proxy: Instance | None = None
        self.routed: dict | None = None  # what the proxy was last told
        self.reported: dict | None = None  # what the registry was last told
        self.ray = ray
        self.http = http or httpx.Client(timeout=10)
        self.log_dir: Path | None = None
        self.proxy_port = args.port  # the proxy's bound port once it runs (a restart keeps it)
        # Instances that left stop in the background (each may take a while to finish its streams)
        self.departing: dict[plan.Member, concurrent.futures.Future] = {}
        self._stopper = concurrent.futures.ThreadPoolExecutor(thread_name_prefix="pdserve-stop")

    def start(self, timeout_s: float = 600.0) -> "RayDeployment":
        ray = self.ray = self.ray or connect(self.args.ray)
        try:
            self.registry = ray.remote(Registry).options(name=REGISTRY, num_cpus=0).remote(
                self.args.prefill, self.args.decode)
        except ValueError:  # the name is taken
            raise SystemExit("a pdserve deployment already runs on this Ray cluster "
                             "(`pdserve ray status` shows it; stop it first)") from None
        self.log_dir = Path(self.args.log_dir or tempfile.mkdtemp(prefix="pdserve-ray-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._start_proxy()
        deadline = time.monotonic() + timeout_s
        while True:
            status = self.reconcile()
            if status["ready"] == status["wanted"]:
                return self
            if time.monotonic() > deadline:
                raise TimeoutError(f"instances not up within {timeout_s:.0f} s: {json.dumps(status)}")

    def _start_proxy(self) -> None:
        tokenizer = []  # kv-aware routing: the proxy tokenizes and renders chats as the instances do
        if Path(self.model).exists():
            tokenizer = ["--tokenizer", self.model, *chat_template_args(shlex.split(self.args.instance_args))]
        self.proxy = Instance("proxy", ["proxy", "--port", str(self.proxy_port), "--host", self.args.host,
                                        *tokenizer, *shlex.split(self.args.proxy_args)], host=self.args.host)
        self.proxy.spawn(self.log_dir, {**self.env, "PDSERVE_ADMIN_KEY": self.admin_key})
        self.proxy.wait_healthy(60, listening_only=True)  # (healthy once a decode instance is routed)
        self.proxy_port = self.proxy.port

    def _actor(self, role: str):
        tp = self.args.prefill_tp if role == "prefill" else self.args.decode_tp
        threads = self.args.ray_threads_per_rank
        cls = self.ray.remote(InstanceActor).options(num_cpus=tp * threads, resources=self.resources[role],
                                                     max_restarts=-1, max_task_retries=0)
        args = [*role_defaults(role), *shlex.split(self.args.instance_args),
                *shlex.split(getattr(self.args, f"{role}_args"))]
        return cls.remote(role, self.model, tp, threads, args, self.env)

    def reconcile(self, wait_s: float = 1.0) -> dict:
        """One round (about `wait_s`): start or stop actors to the wanted counts, hear from every
        actor, route to those that serve."""
        ray = self.ray
        began = time.monotonic()
        self._watch_proxy()
        wanted = ray.get(self.registry.get_wanted.remote(), timeout=30)
        start, stop = plan.changes(wanted, self.members)
        for role, n in start.items():
            self.members += [plan.Member(role, self._actor(role)) for _ in range(n)]
        self.members = [m for m in self.members if m not in stop]
        self._hear(wait_s)
        self._route()  # the ones that go leave the proxy before they stop
        for m in stop:
            self.departing[m] = self._stopper.submit(self._stop, m)
        self.departing = {m: f for m, f in self.departing.items() if not f.done()}
        status = plan.status(wanted, self.members, self.proxy.url)
        if status != self.reported:
            self.registry.report.remote(status)
            self.reported = status
        time.sleep(max(0.0, wait_s - (time.monotonic() - began)))
        return status

    def _watch_proxy(self) -> None:
        """A proxy that exited (crash, OOM, kill) is started again on its port and told the routes."""
        code = self.proxy.proc.poll()
        if code is None:
            return
        logger.error("the proxy exited with %s; starting it again on port %s", code, self.proxy_port)
        try:
            self._start_proxy()
        except (RuntimeError, TimeoutError) as e:
            logger.error("the proxy did not start again (next round tries again): %s", e)
        self.routed = None  # a new proxy knows no instance

    def _hear(self, wait_s: float) -> None:
        for m in self.members:
            if m.pending is None:
                m.pending = m.actor.info.remote()
        pending = [m.pending for m in self.members]
        ready, _ = self.ray.wait(pending, num_returns=len(pending), timeout=wait_s) if pending else ([], [])
        ready = set(ready)
        for m in self.members:
            if m.pending not in ready:
                continue  # starting (its constructor is running) or slow: as it was
            try:
                m.info = self.ray.get(m.pending)
            except Exception as e:  # noqa: BLE001 - died or restarting: not routed until it answers
                m.info = {"alive": False, "state": "down", "error": type(e).__name__}
            m.pending = None

    def _route(self) -> None:
        routes = plan.routes(self.members)
        if routes == self.routed:
            return
        try:
            r = self.http.put(self.proxy.url + "/admin/upstreams", json=routes,
                              headers={"Authorization": f"Bearer {self.admin_key}"})
            r.raise_for_status()
            self.routed = routes
        except httpx.HTTPError as e:
            logger.warning("could not tell the proxy which instances serve: %s", e)

    def _stop(self, m: plan.Member) -> None:
        """On a thread of `_stopper`: graceful (bounded), then the actor goes for good."""
        try:
            self.ray.get(m.actor.stop.remote(), timeout=90)
        except Exception as e:  # noqa: BLE001 - it goes either way
            logger.info("%s instance did not stop by itself: %s", m.role, e)
        try:
            self.ray.kill(m.actor, no_restart=True)
        except Exception as e:  # noqa: BLE001 - already gone
            logger.info("%s actor could not be killed: %s", m.role, e)

    def stop(self) -> None:
        if self.proxy is not None:
            self.proxy.stop()
        for m in self.members:
            self.departing[m] = self._stopper.submit(self._stop, m)
        self.members = []
        concurrent.futures.wait(self.departing.values())  # each bounded by _stop's timeout
        self._stopper.shutdown()
        self.http.close()
        if self.ray is not None:
            self.ray.shutdown()


def run_up(args, model: str) -> int:
    """`pdserve up --ray [ADDRESS]`: start, print the proxy URL, keep routing until Ctrl-C."""
    _check_counts(args, "pdserve up")
    dep = RayDeployment(args, model)

    def describe():
        for m in dep.members:
            yield f"{m.role:8} {m.info['url']}  node {m.info['host']}  log {m.info['log']}"
        yield f"proxy    {dep.proxy.url}/v1  (Ray; `pdserve ray status`, `pdserve ray scale`; Ctrl-C stops)"
    return foreground(args, dep, describe, dep.reconcile)


def _registry(address: str | None):
    ray = connect(address)
    try:
        return ray, ray.get_actor(REGISTRY)
    except ValueError:
        raise SystemExit("no pdserve deployment on this Ray cluster (start one: pdserve up --ray)") from None


def run_scale(args) -> int:
    """`pdserve ray scale`: set the wanted counts, wait until that many serve."""
    _check_counts(args, "pdserve ray scale")
    ray, registry = _registry(args.address)
    wanted = ray.get(registry.scale.remote(args.prefill, args.decode))
    deadline = time.monotonic() + args.timeout_s
    while True:
        status = ray.get(registry.get_status.remote())
        done = status.get("ready") == wanted and len(status.get("instances", [])) == sum(wanted.values())
        if done or time.monotonic() > deadline:
            print(json.dumps({"wanted": wanted, "ready": status.get("ready")}), flush=True)
            return 0 if done else 1
        time.sleep(0.5)


def run_status(args) -> int:
    ray, registry = _registry(args.address)
    status = ray.get(registry.get_status.remote())
    if args.json:
        print(json.dumps(status, indent=1))
        return 0
    print(f"proxy {status.get('proxy')}/v1  wanted {status['wanted']}  ready {status.get('ready')}")
    for i in status.get("instances", []):
        state = "serving" if i.get("alive") else i.get("state", "down") + (f" ({i['error']})" if "error" in i else "")
        print(f"{i['role']:8} {i.get('url', '-'):26} node {i.get('host', '?'):15} {state}")
    return 0
