"""The only code that knows NIXL: an `Agent` (transport/base.py) on host (DRAM) or GPU (VRAM) memory.

TP rank process, called from one thread per agent (agents are not thread-safe). NIXL's own progress
thread is off (in nixl 1.5.1 it busy-polls): the owner makes progress by calling in (`state`,
`notifications`) often enough while transfers or leases are live.
"""

from __future__ import annotations

import logging
import os

import numpy as np

from pdserve.transport.base import TransferError, XferState

logger = logging.getLogger(__name__)


def _import_nixl():
    try:
        from nixl_cu12._api import nixl_agent, nixl_agent_config  # the wheel pdserve pins
    except ImportError:  # pragma: no cover - other NIXL packagings
        from nixl._api import nixl_agent, nixl_agent_config
    return nixl_agent, nixl_agent_config


_SHARED_MEMORY = {"sm", "shm", "cma", "posix", "sysv", "knem", "xpmem"}


def ucx_same_host_warning(ucx_tls: str | None) -> str | None:
    """UCX reads host memory of a process on the same host with cma or shared memory; a UCX_TLS
    that leaves all of them out moves every byte over a network transport (TCP: ~10x slower)."""
    if not ucx_tls:
        return None
    names = {t.strip().lower() for t in ucx_tls.lstrip("^").split(",") if t.strip()}
    if ucx_tls.startswith("^"):
        usable = not ({"sm", "shm"} & names or {"cma", "posix", "sysv"} <= names)
    else:
        usable = "all" in names or bool(_SHARED_MEMORY & names)
    return None if usable else f"UCX_TLS={ucx_tls} leaves out every shared-memory and cma transport"


class NixlAgent:
    def __init__(self, name: str, backend: str = "UCX"):
        nixl_agent, nixl_agent_config = _import_nixl()
        config = nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False,
                                   backends=[backend])
        self.name = name
        self.backend = backend
        self._agent = nixl_agent(name, config)
        self._mem_type = "DRAM"
        self._registered = []
        self._by_address = {}

    def register(self, address: int, size_bytes: int, device: str = "cpu") -> None:
        """Register one contiguous region (the rank's whole KV cache) once, at start."""
        self._mem_type = "DRAM" if device == "cpu" else "VRAM"
        dev_id = 0 if device == "cpu" else int(device.split(":")[-1] or 0)
        descs = self._agent.get_reg_descs([(address, size_bytes, dev_id, "")], self._mem_type)
        self._agent.register_memory(descs)
        self._registered.append(descs)
        self._by_address[address] = descs

    def deregister(self, address: int) -> None:
        """Forget a region registered after the cache (a READ's staging area, once converted)."""
        descs = self._by_address.pop(address)
        self._registered.remove(descs)
        self._agent.deregister_memory(descs)

    def metadata(self) -> bytes:
        return self._agent.get_agent_metadata()

    def add_peer(self, metadata: bytes) -> str:
        """Load a remote agent and connect to it now (not on the first transfer)."""
        name = self._agent.add_remote_agent(metadata)
        name = name.decode() if isinstance(name, bytes) else name
        try:
            self._agent.make_connection(name)
        except Exception as e:  # noqa: BLE001 - the first READ will report a dead peer anyway
            logger.warning("connecting to %s failed: %s", name, e)
        return name

    def remove_peer(self, name: str) -> None:
        try:
            self._agent.remove_remote_agent(name)
        except Exception as e:  # noqa: BLE001
            logger.warning("removing peer %s: %s", name, e)

    def read(self, peer: str, local: np.ndarray, remote: np.ndarray, notification: bytes):
        """Post a READ of `remote` (peer memory) into `local`; the peer gets `notification` once it
        completes. Returns a handle for `state` / `release`."""
        local_d = self._agent.get_xfer_descs(local, self._mem_type)
        remote_d = self._agent.get_xfer_descs(remote, self._mem_type)
        try:
            handle = self._agent.initialize_xfer("READ", local_d, remote_d, peer, notification)
        except Exception as e:  # noqa: BLE001
            raise TransferError(f"cannot create a READ from {peer}: {e}") from e
        try:
            status = self._agent.transfer(handle)
        except Exception as e:  # noqa: BLE001 - NIXL raises on an error status
            self.release(handle)
            raise TransferError(f"posting a READ from {peer} failed: {e}") from e
        if status == "ERR":
            self.release(handle)
            raise TransferError(f"posting a READ from {peer} failed")
        return handle

    def state(self, handle) -> XferState:
        """Also drives progress."""
        try:
            return XferState(self._agent.check_xfer_state(handle))
        except Exception as e:  # noqa: BLE001
            logger.warning("transfer state: %s", e)
            return XferState.ERR

    def release(self, handle) -> None:
        try:
            self._agent.release_xfer_handle(handle)
        except Exception as e:  # noqa: BLE001 - releasing an unfinished READ may be refused
            logger.warning("releasing a transfer handle: %s", e)

    def notifications(self) -> dict[str, list[bytes]]:
        return self._agent.get_new_notifs()

    def notify(self, peer: str, message: bytes) -> None:
        self._agent.send_notif(peer, message)

    def same_host_warning(self) -> str | None:
        return ucx_same_host_warning(os.environ.get("UCX_TLS"))

    def close(self) -> None:
        for descs in self._registered:
            try:
                self._agent.deregister_memory(descs)
            except Exception:  # noqa: BLE001
                pass
        self._registered = []
