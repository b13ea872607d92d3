"""`mci workflow`'s settings: where the endpoint listens, the default deadline, traces, and
the Ray cluster a deployment joins. Imports nothing of Ray."""

from __future__ import annotations

from dataclasses import dataclass

from mci.config_fields import option
from mci.errors import UserError


@dataclass(frozen=True)
class WorkflowConfig:
    """`mci workflow run | serve | deploy` (mci/workflow/)."""

    host: str = option("127.0.0.1", "serve/deploy: address to bind (loopback by default)")
    port: int = option(8000, "serve/deploy: port to listen on")
    default_timeout: float | None = option(
        None,
        "seconds a workflow request may take end to end, unless it says X-Request-Timeout "
        "(also spelled --timeout); every model call gets what is left as its timeout",
        aliases=("--timeout",),
    )
    otlp_traces_endpoint: str | None = option(
        None, "export OpenTelemetry spans over OTLP/HTTP to this URL (e.g. http://HOST:4318)"
    )
    ray_address: str | None = option(
        None, "deploy: Ray cluster to join, e.g. auto or HOST:6379 (default: start a local one)"
    )

    def __post_init__(self):
        if self.default_timeout is not None and not self.default_timeout > 0:
            raise UserError("--default-timeout must be > 0")
