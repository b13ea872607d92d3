"""The engine pipe read on the server's event loop: whole messages out of a Connection's
stream (mci/server/message_reader.py), and the supervisor's hand-over from its reader thread
to the loop, across an engine's death and restart (mci/server/engine_supervisor.py)."""

from __future__ import annotations

import asyncio
import os
import pickle
import struct
import threading
import time
from multiprocessing import Pipe

from mci.core.sampling_params import SamplingParams
from mci.engine import commands
from mci.engine.config import CacheConfig, EngineConfig, ModelPlacement
from mci.model_config import load_config
from mci.server.engine_supervisor import EngineSupervisor
from mci.server.message_reader import READ_BYTES, MessageReader


def _read_until(reader: MessageReader, count: int, timeout_s: float = 10) -> list:
    got, deadline = [], time.monotonic() + timeout_s
    while len(got) < count and time.monotonic() < deadline:
        got += reader.read() or []
    return got


def test_reader_returns_whole_messages_as_send_wrote_them():
    ours, theirs = Pipe(duplex=True)
    reader = MessageReader(ours)
    assert reader.read() == []  # nothing yet: no block
    small = [{"i": i, "text": "x" * i} for i in range(50)]
    for msg in small:
        theirs.send(msg)
    assert _read_until(reader, len(small)) == small
    # larger than one read and than the socket's buffer: arrives in parts while it is written
    big = bytes(range(256)) * (3 * READ_BYTES // 256 + 7)
    writer = threading.Thread(target=theirs.send, args=(big,))
    writer.start()
    assert _read_until(reader, 1) == [big]
    writer.join(5)
    theirs.send("after")
    assert _read_until(reader, 1) == ["after"]
    reader.close()


def test_reader_keeps_a_partial_frame_and_takes_the_long_header():
    ours, theirs = Pipe(duplex=True)
    reader = MessageReader(ours)
    body = pickle.dumps(["long", 7])
    # the 2 GiB+ form (-1, then an 8-byte length), written in pieces
    frame = struct.pack("!i", -1) + struct.pack("!Q", len(body)) + body
    short = struct.pack("!i", len(body)) + body
    fd = theirs.fileno()
    os.write(fd, frame[:3])
    assert reader.read() == []
    os.write(fd, frame[3:10])
    assert reader.read() == []
    os.write(fd, frame[10:] + short[:5])
    assert _read_until(reader, 1) == [["long", 7]]
    os.write(fd, short[5:])
    assert _read_until(reader, 1) == [["long", 7]]
    reader.close()


def test_reader_sees_the_other_end_close_and_the_connection_still_blocks():
    ours, theirs = Pipe(duplex=True)
    reader = MessageReader(ours)
    # the connection's own receive still waits (MSG_DONTWAIT is per read, not the socket's)
    late = threading.Timer(0.3, theirs.send, args=("late",))
    late.start()
    start = time.monotonic()
    assert ours.recv() == "late"
    assert time.monotonic() - start >= 0.2
    theirs.send("last")
    theirs.close()
    assert _read_until(reader, 1) == ["last"]
    assert reader.read() is None  # closed, nothing left
    reader.close()


def _reader_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name == "mci-engine-reader"]


def test_the_loop_takes_the_pipe_over_and_keeps_it_across_a_restart(checkpoint):
    path = checkpoint()
    config = EngineConfig(
        model=ModelPlacement(model_path=path, dtype="float32", skip_kernel_warmup=True),
        cache=CacheConfig(max_total_tokens=2048),
    )
    engine = EngineSupervisor(config, load_config(path))
    try:
        assert _reader_threads() == ["mci-engine-reader"]  # before a loop: a thread reads

        async def generate(rid: str) -> list[int]:
            params = SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True)
            [(_, queue)] = engine.submit(commands.AddRequest(rid, [5, 6, 7], params))
            ids = []
            while True:
                out = await queue.get()
                assert out.error is None
                ids += out.new_token_ids
                if out.finished:
                    return ids

        async def main():
            engine.read_on(asyncio.get_running_loop())
            first = await generate("a")
            deadline = time.monotonic() + 5  # the thread hands over after a message
            while _reader_threads() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert _reader_threads() == []
            assert await generate("b") == first  # outputs now come through the loop
            state = await engine.state()
            assert state["integrity_ok"]
            engine.process.kill()  # the loop sees the pipe close; the death path restarts it
            deadline = time.monotonic() + 60
            while engine.restarts == 0 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert engine.restarts == 1
            assert _reader_threads() == []  # the new engine's pipe went to the loop at once
            assert await generate("c") == first

        asyncio.run(main())
    finally:
        engine.shutdown()
