"""In-process stand-ins for the two networks P/D uses, with the faults tests need to inject.

Test processes (never used in serving). `LoopbackFabric` makes `Agent`s (transport/base.py) that READ
each other's registered memory in this process with memmove and deliver notifications; a test can
make READs slow, fail, hang and land late, lose a peer, duplicate or forge a notification.
`LoopbackNetwork` stands in for the ZMQ side channel: servers by (host, port), replies delivered
when the test calls `pump`, silence turned into the client's timeout. Both take a clock, so a test
moves time instead of sleeping.
"""

from __future__ import annotations

import ctypes
import dataclasses
import itertools
import time
from typing import Callable

import numpy as np

from pdserve.transport.base import TransferError, XferState
from pdserve.transport.deferred import Deferred

Clock = Callable[[], float]


@dataclasses.dataclass(eq=False)
class LoopbackRead:
    """A posted READ; its bytes are copied when it lands (at `state`, or at `land_hung`)."""

    reader: "LoopbackAgent"
    peer: str
    pairs: list[tuple[int, int, int]]  # (local address, remote address, length)
    notification: bytes
    ready_at: float
    hung: bool = False
    failed: bool = False
    landed: bool = False
    released: bool = False


class LoopbackFabric:
    def __init__(self, clock: Clock = time.monotonic):
        self.clock = clock
        self.agents: dict[str, LoopbackAgent] = {}
        self.lost: set[str] = set()
        self.hung: list[LoopbackRead] = []
        # Faults, set by tests; they apply to READs posted from then on.
        self.read_delay_s = 0.0
        self.refuse_reads = False  # posting raises TransferError
        self.fail_reads = False  # posted READs end in ERR without landing
        self.hang_reads = False  # posted READs stay in flight until `land_hung`
        self.hang_readers: set[str] = set()  # ... only those these agents post
        self.duplicate_notifications = False
        self.same_host_warning: str | None = None  # what agents say of a same-host peer
        self.num_reads = 0
        self.num_bytes_read = 0

    def agent(self, name: str, backend: str = "LOOPBACK") -> "LoopbackAgent":
        assert name not in self.agents, f"agent {name} exists"
        self.agents[name] = agent = LoopbackAgent(name, self)
        return agent

    def lose(self, name: str) -> None:
        """The agent's process died: its memory is unreachable, READs from it fail."""
        self.lost.add(name)

    def forge(self, to: str, sender: str, message: bytes) -> None:
        """Deliver a notification that `sender` never sent."""
        self.agents[to].inbox.setdefault(sender, []).append(message)

    def land_hung(self) -> int:
        """Hung READs land now, even those whose reader gave up and released the handle: the late
        write an in-doubt block must be protected from."""
        hung, self.hung = self.hung, []
        for read in hung:
            read.hung = False
            read.reader._land(read)
        return len(hung)


class LoopbackAgent:
    def __init__(self, name: str, fabric: LoopbackFabric):
        self.name = name
        self.fabric = fabric
        self.regions: list[tuple[int, int]] = []
        self.peers: set[str] = set()
        self.inbox: dict[str, list[bytes]] = {}

    def register(self, address: int, size_bytes: int, device: str = "cpu") -> None:
        assert device == "cpu", "the loopback fabric moves host memory only"
        self.regions.append((address, size_bytes))

    def deregister(self, address: int) -> None:
        self.regions = [r for r in self.regions if r[0] != address]

    def metadata(self) -> bytes:
        return b"loopback:" + self.name.encode()

    def add_peer(self, metadata: bytes) -> str:
        name = metadata.removeprefix(b"loopback:").decode(errors="replace")
        if not metadata.startswith(b"loopback:") or name not in self.fabric.agents:
            raise TransferError(f"cannot load agent metadata {metadata[:40]!r}")
        self.peers.add(name)
        return name

    def remove_peer(self, name: str) -> None:
        self.peers.discard(name)

    def read(self, peer: str, local: np.ndarray, remote: np.ndarray, notification: bytes) -> LoopbackRead:
        f = self.fabric
        if peer not in self.peers:
            raise TransferError(f"cannot create a READ from {peer}: not loaded")
        if f.refuse_reads or peer in f.lost:
            raise TransferError(f"posting a READ from {peer} failed: remote disconnect")
        if len(local) != len(remote) or np.any(local[:, 1] != remote[:, 1]):
            raise TransferError("local and remote descriptors differ in count or length")
        _check_inside(self.regions, local, "local")
        _check_inside(f.agents[peer].regions, remote, f"{peer}'s")
        pairs = [(int(l), int(r), int(n)) for l, r, n in zip(local[:, 0], remote[:, 0], local[:, 1])]
        read = LoopbackRead(self, peer, pairs, notification, f.clock() + f.read_delay_s,
                            hung=f.hang_reads or self.name in f.hang_readers, failed=f.fail_reads)
        if read.hung:
            f.hung.append(read)
        f.num_reads += 1
        return read

    def state(self, handle: LoopbackRead) -> XferState:
        if handle.landed:
            return XferState.DONE
        if handle.failed or handle.peer in self.fabric.lost:
            return XferState.ERR
        if handle.hung or self.fabric.clock() < handle.ready_at:
            return XferState.PROC
        self._land(handle)
        return XferState.DONE

    def release(self, handle: LoopbackRead) -> None:
        handle.released = True

    def notifications(self) -> dict[str, list[bytes]]:
        inbox, self.inbox = self.inbox, {}
        return inbox

    def notify(self, peer: str, message: bytes) -> None:
        target = self.fabric.agents.get(peer)
        if target is None or peer in self.fabric.lost or peer not in self.peers:
            raise TransferError(f"cannot notify {peer}: remote disconnect")
        copies = 2 if self.fabric.duplicate_notifications else 1
        target.inbox.setdefault(self.name, []).extend([message] * copies)

    def same_host_warning(self) -> str | None:
        return self.fabric.same_host_warning

    def close(self) -> None:
        self.fabric.agents.pop(self.name, None)

    def _land(self, read: LoopbackRead) -> None:
        for dst, src, n in read.pairs:
            ctypes.memmove(dst, src, n)
            self.fabric.num_bytes_read += n
        read.landed = True
        if read.notification and read.peer not in self.fabric.lost:
            self.notify(read.peer, read.notification)


def _check_inside(regions: list[tuple[int, int]], descs: np.ndarray, whose: str) -> None:
    start = descs[:, 0].astype(np.int64)
    end = start + descs[:, 1].astype(np.int64)
    inside = np.zeros(len(descs), dtype=bool)
    for base, size in regions:
        inside |= (start >= base) & (end <= base + size)
    if not inside.all():
        raise TransferError(f"a descriptor lies outside {whose} registered memory")


# --- the side channel ----------------------------------------------------------------------------

@dataclasses.dataclass
class _Exchange:
    deliver_at: float
    address: tuple[str, int]
    request: object
    on_reply: Callable[[object], None]
    timeout_at: float
    deferred: Deferred | None = None  # the handler's reply, given later by another thread


class LoopbackNetwork:
    """Servers by (host, port). A request is handled and answered at the first `pump` after its
    delivery time; a request nobody answers (no server, `drop`, a handler that raises) gets the
    client's TimeoutError once its timeout has passed."""

    def __init__(self, clock: Clock = time.monotonic):
        self.clock = clock
        self.servers: dict[tuple[str, int], Callable[[object], object]] = {}
        self.pending: list[_Exchange] = []
        self.sent: list[object] = []  # every request, in order (tests count them)
        self.delay_s = 0.0
        self.drop = False
        self._ports = itertools.count(20000)

    def serve(self, host: str, port: int, handler: Callable[[object], object]) -> "LoopbackServer":
        port = port or next(self._ports)
        self.servers[(host, port)] = handler
        return LoopbackServer(self, (host, port))

    def client(self) -> "LoopbackClient":
        return LoopbackClient(self)

    def pump(self) -> int:
        """Deliver what is due; returns how many replies (or timeouts) were delivered."""
        now, delivered, still = self.clock(), 0, []
        pending, self.pending = self.pending, []
        for ex in pending:
            handler = self.servers.get(ex.address)
            if ex.deferred is not None:  # handled: its reply waits for another thread
                reply = ex.deferred.result()
                if reply is None:
                    still.append(ex)
                else:
                    ex.on_reply(reply)
                    delivered += 1
            elif handler is not None and not self.drop and ex.deliver_at <= now:
                try:
                    reply = handler(ex.request)
                except Exception as e:  # noqa: BLE001 - the real server answers nothing
                    reply = TimeoutError(f"no answer (the server failed: {e})")
                if isinstance(reply, Deferred):
                    ex.deferred = reply
                    still.append(ex)
                    continue
                ex.on_reply(reply)
                delivered += 1
            elif ex.timeout_at <= now:
                ex.on_reply(TimeoutError("no answer within the timeout"))
                delivered += 1
            else:
                still.append(ex)
        self.pending = still + self.pending  # callbacks may have sent more
        return delivered


class LoopbackServer:
    def __init__(self, network: LoopbackNetwork, address: tuple[str, int]):
        self.network, self.address = network, address
        self.port = address[1]

    def close(self) -> None:
        self.network.servers.pop(self.address, None)


class LoopbackClient:
    def __init__(self, network: LoopbackNetwork):
        self.network = network

    def send(self, host: str, port: int, request, timeout_s: float,
             on_reply: Callable[[object], None]) -> None:
        n = self.network
        n.sent.append(request)
        now = n.clock()
        n.pending.append(_Exchange(now + n.delay_s, (host, port), request, on_reply, now + timeout_s))

    def close(self) -> None:
        pass
