"""Weighted fair sharing between tenants: the Virtual Token Counter (VTC; Sheng et al., OSDI'24,
"Fairness in Serving Large Language Models").

Each tenant has a counter of the service it has received: every prompt token computed for it
adds INPUT_TOKEN_COST, every generated (or verified) token OUTPUT_TOKEN_COST (the paper's
w_p = 1, w_q = 2: a decode token costs more than a prefill token), divided by the tenant's
weight, so a tenant of weight 3 is owed three times the service of a tenant of weight 1.
The scheduler (policy `fair`) admits from the tenant with the lowest counter, gives the step's
prefill budget to it first, and preempts from the one with the highest (within each priority
class: priority stays the outer order).

Two rules keep it fair and work-conserving:
- a tenant becoming active (its first request waiting or running) is lifted to the lowest
  counter among the active tenants (to the highest of all when none is active), so time spent
  idle is not credit to spend later against the others;
- only active tenants compete: an idle tenant's share goes to the others.
The paper proves that two backlogged tenants' counters then never differ by more than twice
the largest cost one request can add in between; tests/test_fair_share.py measures it.

The counters are kept under every policy (they are cheap, and `/internal/state` reports
them); only `fair` orders by them. Tenants are few and named by the tenants file.
"""

from __future__ import annotations

from dataclasses import dataclass

INPUT_TOKEN_COST = 1.0
OUTPUT_TOKEN_COST = 2.0


@dataclass
class TenantAccount:
    """One tenant's counter (service / weight) and its raw service (token costs)."""

    weight: float = 1.0
    counter: float = 0.0
    service: float = 0.0
    input_tokens: int = 0
    output_tokens: int = 0


class VirtualTokenCounter:
    """The tenants' counters. `active` is always the caller's current set of tenants with a
    request waiting or running."""

    def __init__(self):
        self.accounts: dict[str, TenantAccount] = {}

    def counter(self, tenant: str) -> float:
        account = self.accounts.get(tenant)
        return account.counter if account else 0.0

    def arrive(self, tenant: str, weight: float, active: set[str]) -> None:
        """A request of `tenant` is queued; `active` is taken before it is."""
        account = self.accounts.setdefault(tenant, TenantAccount(weight))
        account.weight = weight  # the latest tenants file's
        if tenant in active:
            return
        others = [self.accounts[t].counter for t in active if t in self.accounts]
        if others:
            floor = min(others)
        else:
            floor = max((a.counter for a in self.accounts.values()), default=0.0)
        account.counter = max(account.counter, floor)

    def charge(self, tenant: str, input_tokens: int, output_tokens: int) -> None:
        account = self.accounts.setdefault(tenant, TenantAccount())
        cost = INPUT_TOKEN_COST * input_tokens + OUTPUT_TOKEN_COST * output_tokens
        account.service += cost
        account.counter += cost / account.weight
        account.input_tokens += input_tokens
        account.output_tokens += output_tokens

    def snapshot(self) -> dict[str, dict]:
        """Per tenant: weight, counter, share of all service so far, tokens."""
        total = sum(a.service for a in self.accounts.values()) or 1.0
        return {
            name: {
                "weight": a.weight,
                "counter": round(a.counter, 3),
                "share": round(a.service / total, 4),
                "input_tokens": a.input_tokens,
                "output_tokens": a.output_tokens,
            }
            for name, a in sorted(self.accounts.items())
        }
