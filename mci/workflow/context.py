"""What travels with every call of one workflow request: its deadline and the path of steps it
has passed. Carried in a ContextVar, as OpenTelemetry carries the current span, because asyncio
copies context into every task a call starts: a step never passes it by hand, and two requests
in one process never see each other's. Across processes (Ray) it travels as `to_wire()`.

Invariant: the deadline only ever shrinks along a call path (a callee gets the caller's, or its
own step timeout if that ends sooner).
"""

from __future__ import annotations

import time
from contextvars import ContextVar
from dataclasses import dataclass, replace


# A model call ends at the deadline itself; step handles stop waiting a little later, inner
# ones sooner than outer ones, so that the error names the innermost step that was running
# rather than the entry. Every wait ends within 50 ms of the deadline.
def handle_grace_s(depth: int) -> float:
    return 0.02 + 0.004 * (8 - min(depth, 8))


@dataclass(frozen=True)
class CallContext:
    """One workflow request's deadline (time.monotonic(), or None) and step path."""

    deadline: float | None = None
    path: tuple[str, ...] = ()

    def remaining_s(self) -> float | None:
        return None if self.deadline is None else self.deadline - time.monotonic()

    def expired(self) -> bool:
        remaining = self.remaining_s()
        return remaining is not None and remaining <= 0

    def within(self, timeout_s: float | None) -> CallContext:
        """This context, its deadline cut to `timeout_s` from now if that is sooner."""
        if timeout_s is None:
            return self
        deadline = time.monotonic() + timeout_s
        if self.deadline is not None:
            deadline = min(deadline, self.deadline)
        return replace(self, deadline=deadline)

    def entering(self, step: str) -> CallContext:
        return replace(self, path=(*self.path, step))

    def to_wire(self) -> dict:
        """For another process: the deadline as seconds left (clocks differ between hosts)."""
        return {"remaining_s": self.remaining_s(), "path": list(self.path)}

    @classmethod
    def from_wire(cls, wire: dict) -> CallContext:
        remaining = wire.get("remaining_s")
        deadline = None if remaining is None else time.monotonic() + remaining
        return cls(deadline, tuple(wire.get("path", ())))


CURRENT: ContextVar[CallContext | None] = ContextVar("mci_workflow_call", default=None)


def current() -> CallContext:
    """The running call's context (an unbounded one outside any workflow)."""
    return CURRENT.get() or CallContext()
