"""Residency: which replicas may serve a tenant's request (docs/router.md, "Residency").

A replica carries labels (`mci serve --region R --pool P`, reported at `GET /server_info`). A
tenant may be pinned to regions and to pools (tenants.py: empty means any), and a request may
narrow its region further with the header `X-Mci-Region` (narrow only: a region its tenant
does not allow is refused, 403). One rule, `allowed`, decides for every front door (the router
over its replicas, the Ray Serve ingress over its deployment), so they cannot disagree; where
no replica passes it, the request fails closed (503) and is never sent elsewhere.

A replica without a label never passes a rule on that label: an unlabelled or not yet heard
from replica is outside every region and pool.
"""

from __future__ import annotations

from dataclasses import dataclass

from mci.tenancy.tenants import Tenant

REGION_HEADER = "x-mci-region"
REASONS = ("region", "pool")  # why a replica was rejected: the metric's only label values
MAX_LABEL_CHARS = 64  # of a header region echoed in a message


@dataclass(frozen=True)
class Labels:
    """A replica's labels (None: not labelled, or not known yet)."""

    region: str | None = None
    pool: str | None = None

    @classmethod
    def from_info(cls, info) -> Labels:
        """The labels of a `/server_info` body (anything else: no labels)."""
        if not isinstance(info, dict):
            return cls()
        region, pool = info.get("region"), info.get("pool")
        return cls(
            region if isinstance(region, str) else None, pool if isinstance(pool, str) else None
        )


def allowed(tenant: Tenant, header_region: str | None, labels: Labels) -> str | None:
    """None when a replica with `labels` may serve this tenant's request (narrowed to
    `header_region`, if given); else why not: "region" or "pool" (REASONS)."""
    if tenant.regions and labels.region not in tenant.regions:
        return "region"
    if header_region is not None and labels.region != header_region:
        return "region"
    if tenant.pools and labels.pool not in tenant.pools:
        return "pool"
    return None


def narrowing_error(tenant: Tenant, header_region: str | None) -> str | None:
    """Why the request's `X-Mci-Region` is refused (a 403), or None: the header may only
    narrow the tenant's regions, never widen them."""
    if header_region is None or not tenant.regions or header_region in tenant.regions:
        return None
    shown = header_region[:MAX_LABEL_CHARS]
    return (
        f"X-Mci-Region {shown!r} is not allowed for tenant {tenant.name!r} "
        f"(its regions: {', '.join(tenant.regions)})"
    )


def describe(tenant: Tenant, header_region: str | None) -> str:
    """The constraint in words, for a fail-closed 503 ("" when there is none)."""
    parts = []
    if header_region is not None:
        parts.append(f"region {header_region[:MAX_LABEL_CHARS]!r} (X-Mci-Region)")
    elif tenant.regions:
        parts.append(f"region {' or '.join(tenant.regions)} (tenant {tenant.name!r})")
    if tenant.pools:
        parts.append(f"pool {' or '.join(tenant.pools)} (tenant {tenant.name!r})")
    return " and ".join(parts)


@dataclass(frozen=True)
class Residency:
    """Where one request may run: its tenant, and the region its header narrowed it to."""

    tenant: Tenant
    region: str | None = None  # X-Mci-Region

    @property
    def restricted(self) -> bool:
        return bool(self.tenant.regions or self.tenant.pools or self.region is not None)

    def rejects(self, labels: Labels) -> str | None:
        return allowed(self.tenant, self.region, labels)

    def describe(self) -> str:
        return describe(self.tenant, self.region)

    def unavailable(self, last: str | None = None) -> str:
        """The fail-closed message: no allowed replica can take the request."""
        why = f"; last failure: {last}" if last else ""
        return (
            f"no replica in {self.describe()} is available; the request is not sent to "
            f"replicas outside it{why}"
        )
