"""The transport seam: how one engine reads KV rows out of another engine's memory.

A transport registers this engine's KV tensor once, names it to peers by a session id, and
reads a batch of byte ranges from a peer's registered memory into its own. Reads, not
writes: the decode side pulls into slots it owns, so nothing it has not reserved is ever
written, and once `read` has returned (done or failed) nothing more of that transfer lands.

`MooncakeTransport` is the Mooncake transfer engine (`mooncake-transfer-engine-non-cuda` on
PyPI: TCP here, RDMA where the hardware has it), peers found by direct handshake
(P2PHANDSHAKE: no metadata server). NIXL or torch.distributed would plug in here.
"""

from __future__ import annotations

import logging
import os
from typing import Protocol

import torch

from mci.errors import UserError

log = logging.getLogger("mci")
# Ranges per batch call: Mooncake's TCP transport refuses a batch of a few thousand (measured:
# 2,000 read, 4,096 refused), and each range costs ~30 us on loopback, so a fragmented pool
# (short runs of slots) makes a transfer slower, never a failure.
MAX_RANGES_PER_BATCH = 1024


class TransferError(RuntimeError):
    """A read failed: the peer is gone, stalled past the timeout, or refused it."""


class KVTransport(Protocol):
    name: str

    @property
    def session_id(self) -> str:
        """How a peer names this engine's registered memory."""

    def register(self, tensor: torch.Tensor) -> None:
        """Make `tensor`'s memory readable by peers (and a read's destination here)."""

    def read(
        self, peer: str, local_addrs: list[int], peer_addrs: list[int], lengths: list[int]
    ) -> None:
        """Copy each peer range into the local one; returns when all landed (TransferError
        when any did not: then none of them will land later)."""

    def close(self) -> None: ...


class MooncakeTransport:
    """The Mooncake transfer engine, one per engine process."""

    name = "mooncake"

    def __init__(self, host: str, ib_device: str | None, progress_timeout_s: float):
        # A read that makes no progress for this long fails (Mooncake's TCP transport), so a
        # stalled peer costs a bounded wait. Set before the engine starts; the operator's own
        # setting wins. Its own log stays quiet unless asked for (MC_LOG_LEVEL): a failure
        # reaches ours as the request's error.
        timeout = str(max(1, round(progress_timeout_s)))
        os.environ.setdefault("MC_TCP_PROGRESS_TIMEOUT_SEC", timeout)
        os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
        try:
            from mooncake.engine import TransferEngine
        except ImportError as exc:
            raise UserError(
                "--disaggregation-transfer-backend mooncake needs the Mooncake transfer engine "
                f"(pip install 'mci[pd]'; it needs libibverbs.so.1, apt install libibverbs1): "
                f"{exc}"
            ) from None
        self._engine = TransferEngine()
        protocol = "rdma" if ib_device else "tcp"
        if self._engine.initialize(host, "P2PHANDSHAKE", protocol, ib_device or "") != 0:
            raise UserError(f"the Mooncake transfer engine could not start on {host} ({protocol})")
        self._session = f"{host}:{self._engine.get_rpc_port()}"
        self._registered: list[int] = []
        log.info("KV transfer engine: mooncake over %s, session %s", protocol, self._session)

    @property
    def session_id(self) -> str:
        return self._session

    def register(self, tensor: torch.Tensor) -> None:
        address, size = tensor.data_ptr(), tensor.numel() * tensor.element_size()
        if self._engine.register_memory(address, size) != 0:
            raise UserError(f"the transfer engine could not register {size} bytes of KV cache")
        self._registered.append(address)

    def read(
        self, peer: str, local_addrs: list[int], peer_addrs: list[int], lengths: list[int]
    ) -> None:
        for start in range(0, len(lengths), MAX_RANGES_PER_BATCH):
            part = slice(start, start + MAX_RANGES_PER_BATCH)
            status = self._engine.batch_transfer_sync_read(
                peer, local_addrs[part], peer_addrs[part], lengths[part]
            )
            if status != 0:
                raise TransferError(
                    f"reading {sum(lengths[part])} bytes in {len(lengths[part])} ranges from "
                    f"{peer} failed ({status})"
                )

    def close(self) -> None:
        for address in self._registered:
            self._engine.unregister_memory(address)
        self._registered.clear()


def open_transport(backend: str, host: str, ib_device: str | None, timeout_s: float):
    """The configured transport (one backend today: mooncake)."""
    if backend != "mooncake":
        raise UserError(f"unknown --disaggregation-transfer-backend {backend!r}")
    return MooncakeTransport(host, ib_device, timeout_s)
