"""The scheduler's seam to prefill-decode disaggregation (mci/disaggregation/ fills it).

A disaggregated request lives in two engines. On the prefill side the scheduler runs it like
any request until its first new token is sampled, then `offer`s its KV (held in the pool) to
the decode side and ends it. On the decode side the scheduler admits it without computing:
it reserves slots for the known tokens and asks the seam to `reserve` (read the KV into them);
when the KV has arrived the request joins the running batch with its first token. Transfers
run on the seam's threads; everything they change in the engine comes back as events that the
engine's thread takes with `poll`, so the pool, the tree and the queues keep one writer.

Invariants: a hold offered is given back exactly once (a `HoldReleased`); a reserved request
ends in exactly one `KVArrived` or `KVFailed`, unless it is cancelled first; slots of a
request whose read may still be writing them stay quarantined until `SlotsSafe`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from mci.cache.kv_manager import KVHold
from mci.core.request import Request


@dataclass(frozen=True)
class KVArrived:
    """Decode side: the request's KV is in its slots; `token_ids` (the first new token) and
    their `logprobs` were sampled by the prefill side, `prompt_logprobs` scored there."""

    request_id: str
    token_ids: tuple[int, ...]
    logprobs: tuple
    prompt_logprobs: list | None = None
    # prompt tokens the prefill side found in its prefix cache (what the pair did not compute)
    cached_tokens: int = 0


@dataclass(frozen=True)
class KVFailed:
    """Decode side: the request cannot get its KV (the prefill side failed, went away or
    stalled). `slots_safe`: no transfer can still write its slots (else a SlotsSafe follows)."""

    request_id: str
    error: str
    slots_safe: bool = True


@dataclass(frozen=True)
class SlotsSafe:
    """Decode side: the read of a cancelled or failed request has returned; its quarantined
    slots can be freed."""

    request_id: str


@dataclass(frozen=True)
class HoldReleased:
    """Prefill side: the decode side has read a hold's KV, or will never read it."""

    hold_id: int


HandoffEvent = KVArrived | KVFailed | SlotsSafe | HoldReleased


class KVHandoff(Protocol):
    """One side of the KV handoff. Called from the engine's thread only; never blocks it."""

    @property
    def busy(self) -> bool:
        """Holds, reads or quarantines outstanding: the engine has work until they end."""

    def expect(self, req: Request) -> None:
        """Prefill side: a request of a room arrived (a decode side asking for it waits)."""

    def offer(self, req: Request, hold: KVHold) -> None:
        """Prefill side: the request's first token is out and its KV held; the decode side of
        its room may read it."""

    def withdraw(self, req: Request, error: str) -> None:
        """Prefill side: the request ended without KV to offer (aborted, failed)."""

    def reserve(self, req: Request) -> None:
        """Decode side: slots for positions [cached_len, num_tokens) are the request's; read
        the KV of those positions into them."""

    def cancel(self, req: Request) -> bool:
        """Decode side: the request ended while reserved. True when no transfer can still
        write its slots; False: they stay quarantined until a SlotsSafe."""

    def poll(self) -> list[HandoffEvent]:
        """Events since the last call."""

    def wait(self, timeout_s: float) -> None:
        """Block up to `timeout_s` for an event (the engine has nothing else to do)."""

    def stats(self) -> dict: ...

    def close(self) -> None: ...
