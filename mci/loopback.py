"""A free TCP port on 127.0.0.1: for the processes mci starts and fronts itself (replica
servers, a single machine's torch.distributed rendezvous)."""

from __future__ import annotations

import socket


def free_loopback_port() -> int:
    """A port free on 127.0.0.1 now (the OS picks it; free until someone binds it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
