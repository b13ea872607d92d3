"""The engine's messages off its pipe without blocking, for an event loop to read them.

`Connection.recv` blocks until a whole message has arrived, so only a thread may call it; a
thread that then hands each output to the event loop costs every streamed token two wake-ups
(the thread's, then the loop's) and a hand-over of the GIL. `MessageReader.read` takes what the
socket holds at once and returns the whole messages in it, keeping a partial one for the next
call: the loop's own readiness callback can call it.

The frames are those `multiprocessing.connection.Connection.send` writes (CPython's
`_send_bytes`): a 4-byte big-endian signed length, or -1 and then an 8-byte length for a
message of 2 GiB or more, then the pickled message.
"""

from __future__ import annotations

import os
import pickle
import socket
import struct
from multiprocessing.connection import Connection

READ_BYTES = 1 << 18  # at most this much a call (a 32-request step's outputs are ~20 KB)
_SHORT = struct.Struct("!i")
_LONG = struct.Struct("!Q")


class MessageReader:
    """Reads one end of a `multiprocessing.Pipe` (a socket) alongside its `Connection`.

    It reads through its own descriptor (a dup of the connection's), each read with
    MSG_DONTWAIT: the connection's own sends and polls stay blocking. Invariant: its buffer
    starts at a frame boundary, so it must take over a pipe between messages (no `recv` of the
    connection may run once it reads)."""

    def __init__(self, conn: Connection):
        self._sock = socket.socket(fileno=os.dup(conn.fileno()))
        self._buffer = bytearray()

    def fileno(self) -> int:
        return self._sock.fileno()

    def read(self) -> list | None:
        """The whole messages that have arrived ([] when none yet); None once the other end
        has closed (the engine exited) and no whole message is left."""
        try:
            data = self._sock.recv(READ_BYTES, socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return []
        except OSError:  # reset: the other end is gone
            data = b""
        if not data:
            return self._messages() or None
        self._buffer += data
        return self._messages()

    def _messages(self) -> list:
        buf, pos, out = self._buffer, 0, []
        while len(buf) - pos >= _SHORT.size:
            (size,) = _SHORT.unpack_from(buf, pos)
            head = _SHORT.size
            if size == -1:
                if len(buf) - pos < _SHORT.size + _LONG.size:
                    break
                (size,) = _LONG.unpack_from(buf, pos + head)
                head += _LONG.size
            if len(buf) - pos - head < size:
                break
            with memoryview(buf) as view:
                out.append(pickle.loads(view[pos + head : pos + head + size]))
            pos += head + size
        del buf[:pos]
        return out

    def close(self) -> None:
        self._sock.close()
