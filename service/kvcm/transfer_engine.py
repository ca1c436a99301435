"""The transfer engine behind KV moves between sidecars: a NIXL agent (UCX underneath).

kvcm moves no byte itself. It registers its memory with one NIXL agent per generation and
asks NIXL to READ a peer's slots into its own, one request per pool with a descriptor per
block: NIXL merges adjacent descriptors and UCX picks the path (shared memory or TCP between
processes of one host, RDMA between hosts, CUDA IPC or GPUDirect for VRAM).

NIXL is an optional extra (``pip install 'kvcm[transfer]' -c constraints.txt``); the wheel
is ``nixl-cu12``, imported as ``nixl_cu12`` (the plain ``nixl`` name also works). Without it,
``NixlEngine`` raises ``TransferUnavailable`` naming the extra.
"""

from __future__ import annotations

import base64
import importlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvcm_client.errors import TransferFailed, TransferUnavailable, UnknownPeer

log = logging.getLogger("kvcm.transfer")

#: Import names of NIXL's Python API, first found wins.
_MODULES = ("nixl_cu12", "nixl._api", "nixl")


def nixl_module() -> Any:
    """NIXL's Python API, or ``TransferUnavailable`` naming the extra to install."""
    for name in _MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(module, "nixl_agent"):
            return module
    raise TransferUnavailable(
        "the transfer engine is not installed: pip install 'kvcm[transfer]' -c constraints.txt "
        "(NIXL, the nixl-cu12 wheel)",
        backend="nixl",
    )


def memory_kind(tensor: torch.Tensor) -> tuple[str, int]:
    """NIXL's memory type and device id of a tensor: ``("VRAM", 0)`` on cuda:0."""
    if tensor.device.type == "cuda":
        return "VRAM", tensor.device.index or 0
    return "DRAM", 0


def _descs(rows: np.ndarray, device: int) -> np.ndarray:
    """NIXL's N x 3 descriptor array: (address, bytes, device id), C-contiguous int64."""
    out = np.empty((rows.shape[0], 3), dtype=np.int64)
    out[:, :2] = rows
    out[:, 2] = device
    return out


@dataclass(slots=True)
class Xfer:
    """One posted READ: NIXL's handle and the bytes it moves."""

    handle: Any
    nbytes: int
    descriptors: int


class NixlEngine:
    """One NIXL agent, named ``name``, over the given memory (module docstring).

    ``regions`` are contiguous tensors (pools, host-tier chunks, state slots): each is
    registered once, here, and stays registered until ``close``.
    """

    backend = "UCX"

    def __init__(self, name: str, regions: Sequence[torch.Tensor]) -> None:
        nixl = nixl_module()
        try:
            config = nixl.nixl_agent_config(backends=[self.backend])
            self.agent = nixl.nixl_agent(name, config)
        except Exception as exc:  # NIXL raises its own types (nixlBackendError, ...)
            raise TransferUnavailable(
                f"NIXL could not start an agent with the {self.backend} backend: {exc}",
                backend="nixl",
            ) from exc
        self.name = name
        self.registered: list[Any] = []
        for tensor in regions:
            if tensor.numel() == 0:
                continue
            kind, device = memory_kind(tensor)
            entry = (tensor.data_ptr(), tensor.numel() * tensor.element_size(), device, "")
            self.registered.append(self.agent.register_memory([entry], kind))
        self.peers: set[str] = set()

    def metadata(self) -> str:
        """This agent's metadata (base64): what a peer loads to read from it."""
        return base64.b64encode(self.agent.get_agent_metadata()).decode()

    def connect(self, metadata: str) -> str:
        """Load a peer's metadata; returns its agent name."""
        raw = base64.b64decode(metadata)
        name = self.agent.add_remote_agent(raw)
        name = name.decode() if isinstance(name, bytes) else str(name)
        self.peers.add(name)
        return name

    def forget(self, name: str) -> None:
        """Drop a peer's metadata (it restarted: its next generation is another agent)."""
        if name in self.peers:
            self.peers.discard(name)
            self.agent.remove_remote_agent(name)

    def read(
        self,
        peer: str,
        local: np.ndarray,
        remote: np.ndarray,
        local_memory: tuple[str, int],
        remote_memory: tuple[str, int],
    ) -> Xfer:
        """Post one READ of ``remote`` rows (address, bytes) of ``peer`` into ``local``
        rows: descriptor i reads ``remote[i, 1]`` bytes from ``remote[i, 0]`` to
        ``local[i, 0]``; each side's memory is (kind, device id)."""
        if peer not in self.peers:
            raise UnknownPeer(f"transfer agent {peer!r} is not connected", peer=peer)
        n = local.shape[0]
        local_descs = self.agent.get_xfer_descs(_descs(local, local_memory[1]), local_memory[0])
        remote_descs = self.agent.get_xfer_descs(_descs(remote, remote_memory[1]), remote_memory[0])
        handle = None
        try:
            handle = self.agent.initialize_xfer("READ", local_descs, remote_descs, peer)
            state = self.agent.transfer(handle)
        except Exception as exc:  # NIXL raises its own types
            if handle is not None:
                self.release(Xfer(handle, 0, n))
            raise TransferFailed(f"NIXL refused the read from {peer!r}: {exc}", peer=peer) from exc
        if state == "ERR":
            self.agent.release_xfer_handle(handle)
            raise TransferFailed(f"NIXL could not post the read from {peer!r}", peer=peer)
        return Xfer(handle, int(local[:, 1].sum()), n)

    def notify(self, peer: str, message: bytes) -> None:
        """Send ``message`` to ``peer``'s agent (best effort: a gone peer needs none)."""
        try:
            self.agent.send_notif(peer, message)
        except Exception as exc:
            log.warning("could not notify %s: %s", peer, exc)

    def state(self, xfer: Xfer) -> str:
        """``DONE``, ``PROC`` or ``ERR``."""
        try:
            return str(self.agent.check_xfer_state(xfer.handle))
        except Exception:  # a peer gone mid-transfer surfaces as an exception in some backends
            return "ERR"

    def release(self, xfer: Xfer) -> bool:
        """Release a transfer's handle (aborting it if it still runs); False when NIXL could
        not (it still runs: its target memory must stay reserved)."""
        try:
            self.agent.release_xfer_handle(xfer.handle)
        except Exception as exc:
            log.warning("could not release a transfer (%s); its blocks stay reserved", exc)
            return False
        return True

    def notifications(self) -> list[tuple[str, bytes]]:
        """Notifications that arrived since the last call: (sender agent, message)."""
        out = []
        for sender, messages in self.agent.get_new_notifs().items():
            out.extend((sender, msg) for msg in messages)
        return out

    def close(self) -> None:
        """Deregister the memory and drop the peers (the agent goes with the object)."""
        for name in list(self.peers):
            self.forget(name)
        for descs in self.registered:
            try:
                self.agent.deregister_memory(descs)
            except Exception as exc:  # closing anyway
                log.warning("NIXL could not deregister memory: %s", exc)
        self.registered.clear()
