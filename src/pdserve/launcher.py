"""A local P/D deployment as processes: prefill and decode instances, then the proxy.

CLI process (`pdserve up`) and tests. Each instance is a `pdserve serve` in its own process group on
port 0 (the bound port comes back through a port file), pinned to its own cores; every child dies
with this process (PR_SET_PDEATHSIG) and `stop` kills the groups, so nothing is left behind.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import os
import secrets
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Callable, Iterable

from pdserve.cpus import parse_cpus


@dataclasses.dataclass
class Instance:
    """One `pdserve` child process (an instance or the proxy) in its own process group."""

    role: str  # "prefill", "decode", "proxy" or anything a test names it
    args: list[str]
    cpus: tuple[int, ...] = ()
    proc: subprocess.Popen | None = None
    port: int | None = None
    log_path: Path | None = None
    port_file: Path | None = None
    host: str = "127.0.0.1"  # where it is reached (the address it binds)
    prefix: list[str] = dataclasses.field(default_factory=list)  # e.g. `ip netns exec NS` (another host)

    @property
    def url(self) -> str:
        return f"http://[{self.host}]:{self.port}" if ":" in self.host else f"http://{self.host}:{self.port}"

    def spawn(self, log_dir: Path, env: dict | None = None) -> "Instance":
        tag = f"{self.role}-{os.getpid()}-{time.monotonic_ns()}"
        self.port_file = log_dir / f"{tag}.port"
        self.log_path = log_dir / f"{tag}.log"
        cmd = [*self.prefix, sys.executable, "-m", "pdserve.cli", *self.args, "--port-file", str(self.port_file)]
        cpus = self.cpus

        def child_setup():
            _die_with_parent()
            if cpus:
                os.sched_setaffinity(0, cpus)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                         env={**os.environ, **(env or {})},
                                         start_new_session=True, preexec_fn=child_setup)
        return self

    def wait_healthy(self, timeout_s: float = 180.0, listening_only: bool = False) -> "Instance":
        """Until `/health` answers 200 (or, `listening_only`, until the port is bound)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.role} exited with {self.proc.returncode}; log: "
                                   f"{self.log_path}\n{_tail(self.log_path)}")
            if self.port is None and self.port_file.exists():
                self.port = json.loads(self.port_file.read_text())["port"]
            if self.port is not None and listening_only:
                return self
            if self.port is not None:
                status, body = _health(self.url + "/health")
                if status == 200:
                    return self
                if "failed" in body:  # the engine could not start: no point waiting
                    raise RuntimeError(f"{self.role} cannot start: {body}; log: {self.log_path}")
            time.sleep(0.1)
        raise TimeoutError(f"{self.role} not healthy within {timeout_s:.0f} s; log: {self.log_path}")

    def signal(self, sig: int) -> None:
        if self.proc is not None:
            signal_group(self.proc, sig)

    def kill(self) -> None:
        """Dies at once, with every process of its group (fault tests)."""
        self.signal(signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait()

    def stop(self, timeout_s: float = 15.0) -> None:
        if self.proc is not None:
            stop_group(self.proc, timeout_s)


def signal_group(proc: subprocess.Popen, sig: int) -> None:
    """`sig` to the process group `proc` leads (started with start_new_session)."""
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def stop_group(proc: subprocess.Popen, timeout_s: float = 15.0) -> None:
    """SIGTERM to the group (graceful), then SIGKILL for whatever of it is left."""
    signal_group(proc, signal.SIGTERM)
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        pass
    signal_group(proc, signal.SIGKILL)
    proc.wait()


def split_cores(cores: list[int], num_instances: int) -> list[tuple[int, ...]]:
    """An even, disjoint share of the cores per instance; shared round-robin when there are fewer
    cores than instances."""
    if num_instances <= len(cores):
        per = len(cores) // num_instances
        return [tuple(cores[i * per:(i + 1) * per]) for i in range(num_instances)]
    return [(cores[i % len(cores)],) for i in range(num_instances)]


DECODE_ARGS = ["--max-prefill-stall-s", "0.1"]  # a decode instance given a prompt to prefill (kv-aware routing
# does, when it holds most of a conversation) splits it into steps that each hold its streams at most
# about the proxy's stall budget (proxy/placement.py); its own --decode-args come after, and win


def role_defaults(role: str, with_producers: bool = True) -> list[str]:
    """What `pdserve up` gives an instance of `role` before any arguments of the user's."""
    return list(DECODE_ARGS) if role == "decode" and with_producers else []


def chat_template_args(instance_args: list[str]) -> list[str]:
    """`--chat-template X` as the instances were given it (either spelling), for the proxy: it
    renders chats as they do to route by the blocks the prompts fill."""
    for i, arg in enumerate(instance_args):
        if arg == "--chat-template" and i + 1 < len(instance_args):
            return [arg, instance_args[i + 1]]
        if arg.startswith("--chat-template="):
            return ["--chat-template", arg.split("=", 1)[1]]
    return []


def _die_with_parent() -> None:
    ctypes.CDLL("libc.so.6").prctl(1, signal.SIGTERM)


def with_kv_events(args: list[str], host: str = "127.0.0.1") -> list[str]:
    """An instance's arguments publishing its KV events (for the proxy's KV index) on `host`, the
    address it serves on (loopback for a local deployment, the node's for Ray), on ports it picks
    itself; unless the arguments already configure them."""
    if any(a.startswith("--kv-events-config") for a in args):
        return list(args)
    where = f"tcp://[{host}]:0" if ":" in host else f"tcp://{host}:0"
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": where, "replay_endpoint": where}
    return [*args, "--kv-events-config", json.dumps(config)]


class Deployment:
    def __init__(self, model: str, prefill_tp: list[int], decode_tp: list[int],
                 instance_args: list[str] | None = None, proxy_port: int = 0,
                 prefill_cpus: list[tuple[int, ...]] | None = None,
                 decode_cpus: list[tuple[int, ...]] | None = None,
                 log_dir: str | None = None, env: dict | None = None, proxy_args: list[str] | None = None,
                 proxy_host: str = "127.0.0.1", role_args: dict[str, list[str]] | None = None):
        cores = sorted(os.sched_getaffinity(0))
        shares = split_cores(cores, len(prefill_tp) + len(decode_tp))
        prefill_cpus = prefill_cpus or shares[:len(prefill_tp)]
        decode_cpus = decode_cpus or shares[len(prefill_tp):]
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="pdserve-up-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        # Every deployment signs its KV transfer params and side channel (docs/security.md).
        self.env = {"PDSERVE_KV_SECRET": os.environ.get("PDSERVE_KV_SECRET") or secrets.token_hex(32),
                    **(env or {})}
        extra = with_kv_events(list(instance_args or []))  # the proxy's KV index reads them
        self.instances: list[Instance] = []
        for role, tps, cpus in (("prefill", prefill_tp, prefill_cpus), ("decode", decode_tp, decode_cpus)):
            for tp, cpu in zip(tps, cpus):
                threads = max(1, len(cpu) // tp)
                args = ["serve", model, "--port", "0", "--tensor-parallel-size", str(tp),
                        "--num-threads", str(threads), "--cpus", ",".join(map(str, cpu)),
                        *role_defaults(role, bool(prefill_tp)), *extra, *(role_args or {}).get(role, [])]
                self.instances.append(Instance(role, args, cpu))
        self.proxy_port = proxy_port
        self.proxy_host = proxy_host
        # routes by the blocks prompts fill, rendering chats with the instances' template
        self.proxy_args = ["--tokenizer", model, *chat_template_args(extra), *(proxy_args or [])]
        self.proxy: Instance | None = None

    @property
    def prefill(self) -> list[Instance]:
        return [i for i in self.instances if i.role == "prefill"]

    @property
    def decode(self) -> list[Instance]:
        return [i for i in self.instances if i.role == "decode"]

    def start(self, timeout_s: float = 180.0) -> "Deployment":
        try:
            for inst in self.instances:
                inst.spawn(self.log_dir, self.env)
            for inst in self.instances:
                inst.wait_healthy(timeout_s)
            proxy_args = ["proxy", "--port", str(self.proxy_port), "--host", self.proxy_host,
                          "--prefill", *[i.url for i in self.prefill],
                          "--decode", *[i.url for i in self.decode], *self.proxy_args]
            self.proxy = Instance("proxy", proxy_args, host=self.proxy_host).spawn(self.log_dir, self.env)
            self.proxy.wait_healthy(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self, timeout_s: float = 15.0) -> None:
        """The proxy first (no new requests), then the producers (each keeps its leases until
        decode has read them, bounded by its drain timeout), then decode (its streams finish)."""
        for group in ([self.proxy] if self.proxy else [], self.prefill, self.decode):
            for inst in group:
                inst.signal(signal.SIGTERM)
            for inst in group:
                inst.stop(timeout_s)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


def _health(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status, ""
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")
    except Exception:  # noqa: BLE001 - not listening yet
        return 0, ""


def _tail(path: Path, n: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def _interrupt(*_) -> None:
    raise KeyboardInterrupt


def run_up(args) -> int:
    """`pdserve up`: start, print the proxy URL, optionally ask once, stop on Ctrl-C."""
    def cpu_list(spec):
        return [parse_cpus(part) for part in spec.split(";")] if spec else None
    dep = Deployment(args.model, [args.prefill_tp] * args.prefill, [args.decode_tp] * args.decode,
                     instance_args=shlex.split(args.instance_args), proxy_port=args.port,
                     prefill_cpus=cpu_list(args.prefill_cpus), decode_cpus=cpu_list(args.decode_cpus),
                     log_dir=args.log_dir, proxy_args=shlex.split(args.proxy_args), proxy_host=args.host,
                     role_args={"prefill": shlex.split(args.prefill_args), "decode": shlex.split(args.decode_args)})

    def describe():
        for inst in dep.instances:
            yield f"{inst.role:8} {inst.url}  cores {','.join(map(str, inst.cpus))}  log {inst.log_path}"
        yield f"proxy    {dep.proxy.url}/v1  (Ctrl-C stops everything)"
    return foreground(args, dep, describe, lambda: time.sleep(3600))


def foreground(args, dep, describe: Callable[[], Iterable[str]], step: Callable[[], None]) -> int:
    """Start `dep` (anything with start(), stop() and a `proxy`), write the port file, print what
    runs, ask `--ask` once, then `step()` until Ctrl-C or SIGTERM (or, with `--exit`, stop)."""
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        dep.start()
        if args.port_file:
            from pdserve.http.listen import write_port_file
            write_port_file(args.port_file, args.host, dep.proxy.port)
        for line in describe():
            print(line, flush=True)
        if args.ask:
            _ask(dep.proxy.url, args.ask, args.max_tokens)
            if args.exit:
                return 0
        while True:
            step()
    except KeyboardInterrupt:
        print("stopping", flush=True)
        return 0
    finally:
        dep.stop()


def _ask(url: str, prompt: str, max_tokens: int) -> None:
    """One chat turn through the proxy, streamed to stdout."""
    body = json.dumps({"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                       "temperature": 0, "stream": True}).encode()
    req = urllib.request.Request(url + "/v1/chat/completions", body, {"Content-Type": "application/json"})
    print(f"question: {prompt}\nanswer: ", end="", flush=True)
    with urllib.request.urlopen(req, timeout=300) as r:
        for line in r:
            line = line.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    print(f"\nerror: {chunk['error']['message']}")
                    return
                for choice in chunk.get("choices", []):
                    print(choice.get("delta", {}).get("content") or "", end="", flush=True)
    print(flush=True)
