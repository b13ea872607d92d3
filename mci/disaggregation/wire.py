"""The bootstrap connection's messages: JSON objects, each behind a 4-byte big-endian length.

    decode -> prefill   {"op": "reserve", "room", "identity", "num_tokens", "start"}
    prefill -> decode   {"op": "wait", "known"}           every HEARTBEAT_S until the KV is held
                        {"op": "ready", "region", "slots", "token_ids", "logprobs",
                         "prompt_logprobs", "cached_tokens"}
                                                           the KV of positions [start, num_tokens)
                        {"op": "error", "message"}
    decode -> prefill   {"op": "done"} after the read     (or the connection closes: given up)
    prefill -> decode   {"op": "ack"}                     the hold was kept until "done" came

One connection per room: either side closing it means the other has given up.
"""

from __future__ import annotations

import json
import socket

HEARTBEAT_S = 0.5  # the prefill side says it is alive this often while the decode side waits
MAX_MESSAGE = 64 << 20  # a ready message of a long prompt with prompt logprobs fits


def send(sock: socket.socket, message: dict) -> None:
    data = json.dumps(message).encode()
    sock.sendall(len(data).to_bytes(4, "big") + data)


def receive(sock: socket.socket, timeout_s: float) -> dict:
    """The next message; ConnectionError when the peer closed, TimeoutError past `timeout_s`
    with nothing (a partial message counts as nothing), ValueError for garbage."""
    sock.settimeout(timeout_s)
    size = int.from_bytes(_exactly(sock, 4), "big")
    if size > MAX_MESSAGE:
        raise ValueError(f"a {size}-byte bootstrap message")
    message = json.loads(_exactly(sock, size))
    if not isinstance(message, dict) or not isinstance(message.get("op"), str):
        raise ValueError("a bootstrap message without an op")
    return message


def _exactly(sock: socket.socket, n: int) -> bytes:
    parts, left = [], n
    while left:
        try:
            chunk = sock.recv(left)
        except TimeoutError:  # socket.timeout
            raise TimeoutError("the peer went silent") from None
        if not chunk:
            raise ConnectionError("the peer closed the connection")
        parts.append(chunk)
        left -= len(chunk)
    return b"".join(parts)
