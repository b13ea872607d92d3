"""Admission per tenant: its queue bound and its token budgets, so that a tenant over its
quota gets 429 and a Retry-After from its own budget while the others go on.

- `max_queued_requests`: requests of the tenant admitted that have not yet produced their first
  token (waiting for the batch, or in prefill) — what a flood piles up; its running share is
  bounded in the engine (`max_running_requests`, the scheduler's per-tenant cap).
- `input_tokens_per_minute`: a token bucket of prompt tokens (full at start, refilled at the
  rate), charged at admission; a request that does not fit waits for the refill.
- `output_tokens_per_minute`: a bucket charged as tokens are generated (what a request will
  generate is not known before); while it is in debt, new requests wait until it refills.
Retry-After is the time the tenant's own budget needs to admit the request (at least 1 s).
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass

from mci.tenancy.tenants import Tenant


@dataclass
class _Bucket:
    rate_per_s: float
    capacity: float
    level: float
    stamp: float

    def refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self.stamp) * self.rate_per_s)
        self.stamp = now

    def wait_for(self, tokens: float) -> float:
        """Seconds until `tokens` fit (0: now)."""
        return max(0.0, (tokens - self.level) / self.rate_per_s)


@dataclass
class _Usage:
    queued: int = 0  # admitted, no token yet
    running: int = 0  # producing tokens
    input: _Bucket | None = None
    output: _Bucket | None = None


@dataclass(frozen=True)
class Refusal:
    """Why a tenant's request was refused, and when to come back."""

    reason: str  # "queue" | "input_tokens" | "output_tokens"
    message: str
    retry_after_s: int


class TenantQuotas:
    """Each tenant's usage against its quotas (thread-safe: the reader thread reports outputs)."""

    def __init__(self, clock=time.monotonic):
        self._clock = clock
        self._usage: dict[str, _Usage] = {}
        self._lock = threading.Lock()

    def _of(self, tenant: Tenant, now: float) -> _Usage:
        usage = self._usage.setdefault(tenant.name, _Usage())
        for attr, per_minute in (
            ("input", tenant.input_tokens_per_minute),
            ("output", tenant.output_tokens_per_minute),
        ):
            bucket = getattr(usage, attr)
            if per_minute is None:
                setattr(usage, attr, None)
            elif bucket is None or bucket.capacity != per_minute:  # new, or a reloaded quota
                setattr(usage, attr, _Bucket(per_minute / 60, per_minute, per_minute, now))
            else:
                bucket.refill(now)
        return usage

    def admit(self, tenant: Tenant, num_samples: int, prompt_tokens: int) -> Refusal | None:
        """Admit a request (its samples counted as queued) or say why not."""
        with self._lock:
            now = self._clock()
            usage = self._of(tenant, now)
            cap = tenant.max_queued_requests
            if cap is not None and usage.queued + num_samples > cap:
                return Refusal(
                    "queue",
                    f"tenant {tenant.name} has {usage.queued} requests queued (its bound is {cap})",
                    1,
                )
            if usage.output is not None and usage.output.level < 0:
                wait = usage.output.wait_for(0)
                return Refusal(
                    "output_tokens",
                    f"tenant {tenant.name} is over its output_tokens_per_minute",
                    _seconds(wait),
                )
            if usage.input is not None:
                if prompt_tokens > usage.input.capacity:
                    return Refusal(
                        "input_tokens",
                        f"the prompt ({prompt_tokens} tokens) exceeds tenant {tenant.name}'s "
                        f"input_tokens_per_minute ({int(usage.input.capacity)})",
                        60,
                    )
                if prompt_tokens > usage.input.level:
                    return Refusal(
                        "input_tokens",
                        f"tenant {tenant.name} is over its input_tokens_per_minute",
                        _seconds(usage.input.wait_for(prompt_tokens)),
                    )
                usage.input.level -= prompt_tokens
            usage.queued += num_samples
            return None

    def started(self, tenant: str) -> None:
        """A sample produced its first token: no longer queued."""
        with self._lock:
            usage = self._usage.get(tenant)
            if usage is not None and usage.queued > 0:
                usage.queued -= 1
                usage.running += 1

    def finished(self, tenant: str, started: bool) -> None:
        with self._lock:
            usage = self._usage.get(tenant)
            if usage is None:
                return
            if started:
                usage.running = max(0, usage.running - 1)
            else:
                usage.queued = max(0, usage.queued - 1)

    def generated(self, tenant: str, tokens: int) -> None:
        with self._lock:
            usage = self._usage.get(tenant)
            if usage is not None and usage.output is not None:
                usage.output.refill(self._clock())
                usage.output.level -= tokens

    def snapshot(self) -> dict:
        with self._lock:
            return {
                name: {
                    "queued": u.queued,
                    "running": u.running,
                    "input_tokens_left": None if u.input is None else int(u.input.level),
                    "output_tokens_left": None if u.output is None else int(u.output.level),
                }
                for name, u in sorted(self._usage.items())
            }


def _seconds(wait_s: float) -> int:
    return max(1, math.ceil(wait_s))
