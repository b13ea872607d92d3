"""Which side of a disaggregated pair a request's KV is on, from the router's headers.

`mci router --pd-disaggregation` sends each request to a prefill worker and a decode worker
with one room (X-Mci-Bootstrap-Room); the decode worker's copy also names the prefill
worker's bootstrap server (X-Mci-Bootstrap-Addr). A worker that is not of the kind the
headers address answers 400 rather than compute the request the wrong way; without the
headers every worker serves the request by itself (colocated).
"""

from __future__ import annotations

import re

from mci.core.request import KVHandoff
from mci.disaggregation.config import DisaggregationConfig
from mci.server.errors import HTTPError

ROOM_HEADER = "x-mci-bootstrap-room"
ADDR_HEADER = "x-mci-bootstrap-addr"
_ROOM = re.compile(r"[A-Za-z0-9._-]{1,128}")
_ADDR = re.compile(r"[A-Za-z0-9.\-\[\]:]{1,255}:[0-9]{1,5}")


def handoff_of(headers, config: DisaggregationConfig) -> KVHandoff | None:
    room, addr = headers.get(ROOM_HEADER), headers.get(ADDR_HEADER)
    if room is None and addr is None:
        return None
    mode = config.disaggregation_mode
    if room is None or not _ROOM.fullmatch(room):
        raise _bad(f"{ROOM_HEADER} must be 1-128 of [A-Za-z0-9._-]")
    if mode == "prefill" and addr is None:
        return KVHandoff(room)
    if mode == "decode" and addr is not None:
        if not _ADDR.fullmatch(addr):
            raise _bad(f"{ADDR_HEADER} must be host:port")
        return KVHandoff(room, addr)
    if mode == "null":
        raise _bad("this server is neither a prefill nor a decode worker (--disaggregation-mode)")
    wanted = "without" if mode == "prefill" else "with"
    raise _bad(f"a {mode} worker takes {ROOM_HEADER} {wanted} {ADDR_HEADER}")


def bootstrap_address(config: DisaggregationConfig) -> str | None:
    """What a prefill worker tells the router (/server_info): where decode workers connect."""
    if config.disaggregation_mode != "prefill":
        return None
    return f"{config.disaggregation_host}:{config.disaggregation_bootstrap_port}"


def _bad(message: str) -> HTTPError:
    return HTTPError(400, message, "invalid_request_error")
