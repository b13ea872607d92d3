"""The prefill side of the KV handoff: a bootstrap server that decode workers connect to, one
connection per room, and the rooms this engine has seen.

    engine thread:  expect(room) ........ offer(room, hold) ......................... poll()
                                              │                                   HoldReleased
    handler thread: reserve ─ wait, wait ─────┴─> ready (region, slots, token) ─ done ─> ack
                    (decode side)                  the decode side reads the rows

A hold stays until the decode side says "done" (its read has returned) or gives up (closes,
errs, stays silent past the hold bound), so the prefill side never lets go of rows a read may
still be copying; "ack" tells the decode side that the hold was there to the end (a "done"
after the prefill side gave up finds the connection closed, and the decode side drops what it
read). Handler threads only read rooms and post events; the pool is the engine thread's.
"""

from __future__ import annotations

import logging
import queue
import select
import socket
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

from mci.cache.kv_manager import KVHold
from mci.core.request import Request
from mci.disaggregation import wire
from mci.disaggregation.region import KVRegion
from mci.disaggregation.transport import KVTransport
from mci.scheduler.handoff import HandoffEvent, HoldReleased

log = logging.getLogger("mci")
REAP_EVERY_S = 0.5
HOLD_BOUND_FACTOR = 3  # a decode side silent this many timeouts after "ready" has given up
# an offer no decode side came for in this many timeouts is released (a decode worker admits
# the request only when it has room for it: a busy one comes late)
UNCLAIMED_FACTOR = 6


@dataclass
class _Room:
    """What this engine knows of one room. Guarded by PrefillSide._lock."""

    created: float
    expected: bool = False  # the request arrived here
    offer: dict | None = None  # token ids, logprobs, slots: the ready message but the region
    hold_id: int | None = None
    offered_at: float | None = None
    error: str | None = None  # the request ended without KV
    claimed: bool = False  # a decode side's connection took the offer
    abandoned: bool = False  # the decode side gave up before the offer came
    event: threading.Event = field(default_factory=threading.Event)


class PrefillSide:
    """Satisfies scheduler.handoff.KVHandoff for a prefill worker."""

    def __init__(
        self,
        transport: KVTransport,
        region: KVRegion,
        identity: str,
        host: str,
        port: int,
        timeout_s: float,
    ):
        self.transport = transport
        self.region = region
        self.identity = identity
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._rooms: dict[str, _Room] = {}
        self._events: queue.SimpleQueue[HandoffEvent] = queue.SimpleQueue()
        self._posted = threading.Event()
        self._unreleased: set[int] = set()  # offered holds not yet released (engine thread)
        self._counts: Counter[str] = Counter()
        self._last_reap = 0.0
        self._closing = threading.Event()
        try:
            self._server = socket.create_server((host, port), backlog=256)
        except OSError as exc:
            from mci.errors import UserError

            raise UserError(f"--disaggregation-bootstrap-port {port} on {host}: {exc}") from None
        self.address = f"{host}:{self._server.getsockname()[1]}"
        threading.Thread(target=self._accept, name="mci-kv-bootstrap", daemon=True).start()
        log.info("prefill worker: KV bootstrap server on %s", self.address)

    # ---- the engine thread --------------------------------------------------------------------
    @property
    def busy(self) -> bool:
        return bool(self._unreleased)

    def expect(self, req: Request) -> None:
        with self._lock:
            self._room(req.handoff.room).expected = True

    def offer(self, req: Request, hold: KVHold) -> None:
        new = req.token_ids[len(hold.slots) :]
        logprobs = req.logprobs[-len(new) :] if req.logprobs and new else [None] * len(new)
        payload = {
            "slots": hold.slots.tolist(),
            "token_ids": new,
            "logprobs": logprobs,
            "prompt_logprobs": req.prompt_logprobs,
            "cached_tokens": req.num_cached_prompt_tokens,
        }
        self._unreleased.add(hold.hold_id)
        with self._lock:
            room = self._room(req.handoff.room)
            gone = room.abandoned or room.claimed
            if not gone:
                room.offer, room.hold_id, room.offered_at = payload, hold.hold_id, time.monotonic()
                room.event.set()
        if gone:  # the decode side gave up already: nobody will read it
            self._release(hold.hold_id)

    def withdraw(self, req: Request, error: str) -> None:
        with self._lock:
            room = self._room(req.handoff.room)
            room.error = error
            room.event.set()

    def reserve(self, req: Request) -> None:
        raise RuntimeError("a prefill worker does not receive KV")

    def cancel(self, req: Request) -> bool:
        return True

    def poll(self) -> list[HandoffEvent]:
        self._posted.clear()
        now = time.monotonic()
        if now - self._last_reap >= REAP_EVERY_S:
            self._last_reap = now
            self._reap(now)
        events = []
        while True:
            try:
                event = self._events.get_nowait()
            except queue.Empty:
                break
            if isinstance(event, HoldReleased):
                self._unreleased.discard(event.hold_id)
            events.append(event)
        return events

    def wait(self, timeout_s: float) -> None:
        self._posted.wait(timeout_s)

    def stats(self) -> dict:
        with self._lock:
            rooms = len(self._rooms)
        return {"mode": "prefill", "bootstrap": self.address, "rooms": rooms, **self._counts}

    def close(self) -> None:
        self._closing.set()
        self._server.close()
        self.transport.close()

    def _reap(self, now: float) -> None:
        """Rooms nobody came for: an offer unclaimed past its bound is released; rooms that
        ended long ago (failed, or given up by their decode side) are forgotten."""
        with self._lock:
            for name, room in list(self._rooms.items()):
                if room.claimed:
                    continue  # its handler forgets it
                computing = room.expected and room.offer is None and room.error is None
                if computing:
                    continue  # its request is in the engine: an offer or a withdrawal follows
                since = room.offered_at if room.offer is not None else room.created
                if now - since < UNCLAIMED_FACTOR * self.timeout_s:
                    continue
                del self._rooms[name]
                if room.offer is not None:
                    self._counts["offers_unclaimed"] += 1
                    self._release(room.hold_id)

    # ---- handler threads ----------------------------------------------------------------------
    def _room(self, name: str) -> _Room:
        """The room's entry (lock held)."""
        room = self._rooms.get(name)
        if room is None:
            room = self._rooms[name] = _Room(time.monotonic())
        return room

    def _release(self, hold_id: int) -> None:
        self._events.put(HoldReleased(hold_id))
        self._posted.set()

    def _accept(self) -> None:
        while not self._closing.is_set():
            try:
                sock, _ = self._server.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._serve, args=(sock,), daemon=True).start()

    def _serve(self, sock: socket.socket) -> None:
        name, hold_id, released = None, None, False
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            ask = wire.receive(sock, self.timeout_s)
            if ask.get("op") != "reserve":
                raise ValueError(f"expected reserve, got {ask.get('op')!r}")
            if ask.get("identity") != self.identity:
                wire.send(sock, _error("the decode worker runs another model, dtype or layout"))
                return
            name, start, total = str(ask["room"]), int(ask["start"]), int(ask["num_tokens"])
            claimed = self._claim(sock, name)
            if claimed is None:
                return
            offer, hold_id = claimed
            slots = offer["slots"]
            if len(slots) != total or not 0 <= start < total:
                wire.send(
                    sock,
                    _error(f"the prefill worker computed {len(slots)} tokens, not {total}"),
                )
                return
            ready = {"op": "ready", "region": self.region.as_wire(), **offer}
            ready["slots"] = slots[start:]
            wire.send(sock, ready)
            reply = wire.receive(sock, HOLD_BOUND_FACTOR * self.timeout_s)
            if reply.get("op") == "done":
                self._release(hold_id)
                released = True
                wire.send(sock, {"op": "ack"})
                self._counts["transfers"] += 1
                self._counts["transfer_tokens"] += total - start
            else:
                self._counts["transfers_failed"] += 1
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.debug("KV bootstrap connection for %s ended: %s", name, exc)
            if hold_id is not None:
                self._counts["transfers_failed"] += 1
        finally:
            if hold_id is not None and not released:
                self._release(hold_id)
            if name is not None:
                with self._lock:
                    room = self._rooms.get(name)
                    if room is not None and room.claimed:
                        del self._rooms[name]
                    elif room is not None:  # an offer coming later is released at once
                        room.abandoned = True
            sock.close()

    def _claim(self, sock: socket.socket, name: str) -> tuple[dict, int] | None:
        """Wait for the room's offer, saying so every heartbeat; None when the room ended
        without one (an error sent) or the decode side left (the room marked abandoned)."""
        since = time.monotonic()
        while not self._closing.is_set():
            with self._lock:
                room = self._room(name)
                if room.claimed:
                    wire.send(sock, _error(f"room {name} was claimed twice"))
                    return None
                if room.offer is not None:
                    room.claimed = True
                    return room.offer, room.hold_id
                if room.error is not None:
                    error = room.error
                elif not room.expected and time.monotonic() - since > self.timeout_s:
                    error = f"this prefill worker never received request {name}"
                    room.error = error
                else:
                    error = None
                event, known = room.event, room.expected
            if error is not None:
                wire.send(sock, _error(error))
                return None
            if event.wait(wire.HEARTBEAT_S):
                continue
            if _closed(sock):
                with self._lock:
                    self._room(name).abandoned = True
                return None
            wire.send(sock, {"op": "wait", "known": known})
        return None


def _error(message: str) -> dict:
    return {"op": "error", "message": message}


def _closed(sock: socket.socket) -> bool:
    """The peer closed (or sent what it should not have while waiting)."""
    readable, _, _ = select.select([sock], [], [], 0)
    return bool(readable)
