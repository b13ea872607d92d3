"""The ingress's residency check (no Ray imported, so it is tested without the extra).

Every replica of a `mci serve-ray` deployment carries the same labels (`--region`, `--pool`:
ServerConfig is shared), so the ingress decides once per request, with the router's rule
(mci/tenancy/residency.py) and the router's admission (a 401 for an unknown key, a 403 for an
X-Mci-Region its tenant does not allow): a tenant the deployment's labels exclude gets a
fail-closed 503 and no replica ever sees its request.
"""

from __future__ import annotations

from starlette.responses import JSONResponse

from mci.router.app import admit, error_response
from mci.tenancy.residency import Labels
from mci.tenancy.tenants import TenantTable


def refusal(tenants: TenantTable, headers, labels: Labels) -> JSONResponse | None:
    """None when this deployment (its `labels`) may serve the request; else the answer."""
    residency = admit(tenants, headers)
    if isinstance(residency, JSONResponse):
        return residency
    if residency.rejects(labels) is None:
        return None
    region, pool = labels.region or "none", labels.pool or "none"
    return error_response(
        503, f"{residency.unavailable()} (this deployment: region {region}, pool {pool})"
    )
