"""The transport seam: what a TP rank's connector needs from a one-sided READ fabric.

TP rank process. Two implementations: `nixl_agent.NixlAgent` (the data plane, the only NIXL code)
and `loopback.LoopbackAgent` (in-process, for unit tests, with fault injection). An agent is not
thread-safe: one thread makes every call on it.
"""

from __future__ import annotations

import enum
from typing import Callable, Protocol

import numpy as np


class XferState(enum.Enum):
    DONE = "DONE"
    PROC = "PROC"  # still in flight (an agent progresses only while its owner calls in)
    ERR = "ERR"  # failed; the peer may be gone


class TransferError(RuntimeError):
    """A READ could not be created or posted (the peer is unknown, gone, or the memory is not
    registered)."""


class Agent(Protocol):
    name: str

    def register(self, address: int, size_bytes: int, device: str = "cpu") -> None:
        """Register one contiguous region (a rank's whole KV cache) once, at start, or a READ's
        staging area (model/kv_dtype.py conversions) until `deregister`."""

    def deregister(self, address: int) -> None:
        """Forget a region `register` was given (its base address)."""

    def metadata(self) -> bytes:
        """What a peer loads (`add_peer`) to read this agent's registered memory."""

    def add_peer(self, metadata: bytes) -> str:
        """Load a remote agent, connect now, and return its name."""

    def remove_peer(self, name: str) -> None: ...

    def read(self, peer: str, local: np.ndarray, remote: np.ndarray, notification: bytes) -> object:
        """Post a READ of `remote` descriptors (peer memory) into `local` ones, both Nx3 uint64
        (address, length, device id). The peer receives `notification` (unless empty) once the READ
        has landed. Returns a handle for `state` / `release`; raises TransferError."""

    def state(self, handle: object) -> XferState: ...

    def release(self, handle: object) -> None: ...

    def notifications(self) -> dict[str, list[bytes]]:
        """Notifications received since the last call, by sender agent name."""

    def notify(self, peer: str, message: bytes) -> None: ...

    def close(self) -> None: ...

    def same_host_warning(self) -> str | None:
        """Why READs from a peer on this host would be slow (no shared-memory transport), or None."""


AgentFactory = Callable[[str], Agent]  # agent name -> a new agent
