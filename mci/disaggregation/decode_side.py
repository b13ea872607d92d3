"""The decode side of the KV handoff: for each reserved request, a thread that asks the
prefill worker for its room's KV, reads it into the request's slots and reports back.

    engine thread:  reserve(req: slots for [start, n)) ─────────────────────────> poll()
                                                                     KVArrived | KVFailed
    read thread:    connect ─ reserve ─ wait.. ─ ready ─ read rows ─ done ─ ack
                    (a silent prefill side, a refused or stalled read: KVFailed)

Only this engine writes its slots: it reads (pulls) the rows, so a prefill worker that dies or
stalls can never write into memory this engine has given to another request. A request that
ends while its read is in flight (`cancel` answers False) keeps its slots quarantined until
the read has returned (`SlotsSafe`); the transport bounds how long a stalled read takes.
"""

from __future__ import annotations

import logging
import queue
import socket
import threading
import time
from collections import Counter
from dataclasses import dataclass

from mci.core.request import Request
from mci.disaggregation import wire
from mci.disaggregation.region import KVRegion, read_plan
from mci.disaggregation.transport import KVTransport, TransferError
from mci.scheduler.handoff import HandoffEvent, KVArrived, KVFailed, SlotsSafe

log = logging.getLogger("mci")
CONNECT_TIMEOUT_S = 5.0


@dataclass
class _Read:
    """One request's transfer. `cancelled` and `reading` are guarded by DecodeSide._lock."""

    request_id: str
    room: str
    source: str  # the prefill worker's bootstrap address
    start: int  # first position to read (the ones before are in this engine's cache)
    num_tokens: int
    slots: list[int]  # this engine's slots of positions [start, num_tokens)
    cancelled: bool = False
    reading: bool = False
    sock: socket.socket | None = None


class DecodeSide:
    """Satisfies scheduler.handoff.KVHandoff for a decode worker."""

    def __init__(self, transport: KVTransport, region: KVRegion, identity: str, timeout_s: float):
        self.transport = transport
        self.region = region
        self.identity = identity
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._reads: dict[str, _Read] = {}  # reserved, not yet reported or cancelled
        self._live = 0  # read threads still running (a cancelled read may still be copying)
        self._events: queue.SimpleQueue[HandoffEvent] = queue.SimpleQueue()
        self._posted = threading.Event()
        self._counts: Counter[str] = Counter()
        self._seconds = 0.0  # reading, over all transfers
        self._bytes = 0

    # ---- the engine thread --------------------------------------------------------------------
    @property
    def busy(self) -> bool:
        with self._lock:
            return bool(self._reads) or self._live > 0 or not self._events.empty()

    def expect(self, req: Request) -> None:
        raise RuntimeError("a decode worker does not compute prompts for another worker")

    def offer(self, req: Request, hold) -> None:
        raise RuntimeError("a decode worker does not compute prompts for another worker")

    def withdraw(self, req: Request, error: str) -> None:
        pass

    def reserve(self, req: Request) -> None:
        start = req.cached_len
        read = _Read(
            req.request_id,
            req.handoff.room,
            req.handoff.source,
            start,
            req.num_tokens,
            req.slots[start : req.num_tokens].tolist(),
        )
        with self._lock:
            self._reads[read.request_id] = read
            self._live += 1
        threading.Thread(target=self._run, args=(read,), daemon=True).start()

    def cancel(self, req: Request) -> bool:
        with self._lock:
            read = self._reads.pop(req.request_id, None)
            if read is None:
                return True
            read.cancelled = True
            if read.sock is not None:  # wakes the thread; closing tells the prefill side
                try:
                    read.sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            self._counts["transfers_cancelled"] += 1
            return not read.reading

    def poll(self) -> list[HandoffEvent]:
        self._posted.clear()
        events = []
        while True:
            try:
                events.append(self._events.get_nowait())
            except queue.Empty:
                return events

    def wait(self, timeout_s: float) -> None:
        self._posted.wait(timeout_s)

    def stats(self) -> dict:
        n = self._counts["transfers"]
        return {
            "mode": "decode",
            "transport": self.transport.name,
            **self._counts,
            "transfer_bytes": self._bytes,
            "transfer_seconds": round(self._seconds, 6),
            "mean_transfer_ms": round(1e3 * self._seconds / n, 3) if n else None,
        }

    def close(self) -> None:
        with self._lock:
            reads = list(self._reads.values())
        for read in reads:
            if read.sock is not None:
                try:
                    read.sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        self.transport.close()

    # ---- read threads -------------------------------------------------------------------------
    def _post(self, event: HandoffEvent) -> None:
        self._events.put(event)
        self._posted.set()

    def _report(self, read: _Read, event: HandoffEvent) -> None:
        """The read's one outcome, unless it was cancelled (the scheduler has moved on)."""
        with self._lock:
            if read.cancelled:
                return
            del self._reads[read.request_id]
            self._post(event)

    def _run(self, read: _Read) -> None:
        try:
            self._report(read, self._transfer(read))
        except Exception as exc:  # noqa: BLE001 - every failure is the request's, reported
            self._counts["transfers_failed"] += 1
            why = str(exc) or type(exc).__name__
            if not read.cancelled:
                log.warning("KV transfer of %s from %s failed: %s", read.room, read.source, why)
            self._report(read, KVFailed(read.request_id, f"KV transfer failed: {why}"))
        finally:
            if read.sock is not None:
                read.sock.close()
            with self._lock:
                self._live -= 1
            self._posted.set()

    def _transfer(self, read: _Read) -> KVArrived:
        host, _, port = read.source.rpartition(":")
        try:
            sock = socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S)
        except OSError as exc:
            raise ConnectionError(f"prefill worker {read.source} unreachable ({exc})") from None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self._lock:
            read.sock = sock
            if read.cancelled:
                raise ConnectionError("cancelled")
        ask = {
            "op": "reserve",
            "room": read.room,
            "identity": self.identity,
            "num_tokens": read.num_tokens,
            "start": read.start,
        }
        wire.send(sock, ask)
        while True:  # the prefill side's heartbeats, until its KV is held
            try:
                message = wire.receive(sock, self.timeout_s)
            except TimeoutError:
                raise TimeoutError(
                    f"prefill worker {read.source} silent for {self.timeout_s:g} s"
                ) from None
            if message["op"] == "error":
                raise RuntimeError(f"prefill worker {read.source}: {message.get('message')}")
            if message["op"] == "ready":
                break
        peer = KVRegion.from_wire(message["region"])
        local_addrs, peer_addrs, lengths = read_plan(
            self.region, read.slots, peer, [int(s) for s in message["slots"]]
        )
        with self._lock:
            if read.cancelled:
                raise ConnectionError("cancelled")
            read.reading = True
        start = time.perf_counter()
        try:
            self.transport.read(peer.session, local_addrs, peer_addrs, lengths)
        finally:
            with self._lock:
                read.reading = False
                if read.cancelled:  # its slots were quarantined: free to go now
                    self._post(SlotsSafe(read.request_id))
        elapsed = time.perf_counter() - start
        wire.send(sock, {"op": "done"})
        if wire.receive(sock, self.timeout_s).get("op") != "ack":
            raise TransferError("the prefill worker did not keep the KV to the end of the read")
        self._counts["transfers"] += 1
        self._counts["transfer_ranges"] += len(lengths)
        self._seconds += elapsed
        self._bytes += sum(lengths)
        return KVArrived(
            read.request_id,
            tuple(int(t) for t in message["token_ids"]),
            tuple(_logprob(entry) for entry in message["logprobs"]),
            _prompt_logprobs(message.get("prompt_logprobs")),
            int(message.get("cached_tokens") or 0),
        )


def _logprob(entry):
    """A sampled token's logprob entry as the sampler makes it: (logprob, [(id, lp), ...])."""
    if entry is None:
        return None
    logprob, top = entry
    return (logprob, [tuple(pair) for pair in top])


def _prompt_logprobs(entries):
    return None if entries is None else [_logprob(entry) for entry in entries]
