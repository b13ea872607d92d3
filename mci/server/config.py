"""The HTTP front end's settings (`mci serve`): where it listens, its limits, and how it
supervises its engine."""

from __future__ import annotations

from dataclasses import dataclass

from mci.config_fields import check_choices, option
from mci.errors import UserError


@dataclass(frozen=True)
class ServerConfig:
    """The HTTP front end of `mci serve`."""

    host: str = option("127.0.0.1", "address to bind (loopback by default)")
    port: int = option(30000, "port to listen on")
    served_model_name: str | None = option(None, "model name in the API (default: the directory)")
    api_key: str | None = option(
        None, "require 'Authorization: Bearer KEY' on the API", secret=True
    )
    tenants: str | None = option(
        None,
        "tenants file (JSON or YAML; docs/tenancy.md): API keys -> tenants with weights, "
        "quotas, models and regions; reloaded on SIGHUP (replaces --api-key)",
    )
    region: str | None = option(
        None,
        "this replica's region label (reported at /server_info): the router sends a tenant "
        "pinned to regions only to replicas labelled with one of them",
    )
    pool: str | None = option(
        None,
        "this replica's pool label (reported at /server_info): a tenant with pools is served "
        "only by replicas of those pools (dedicated capacity)",
    )
    context_length: int | None = option(None, "max prompt + output tokens (default: the model's)")
    max_queued_requests: int = option(256, "requests waiting beyond the running batch before 429")
    request_timeout: float | None = option(None, "seconds before a request is aborted")
    drain_timeout: float = option(30.0, "seconds to let requests finish after SIGTERM")
    max_request_bytes: int = option(4 * 2**20, "largest request body accepted (413 beyond)")
    health_generate_timeout: float = option(20.0, "seconds /health_generate waits for a token")
    dp_size: int = option(
        1,
        "data-parallel replicas: start N servers on the next N ports behind the cache-aware "
        "router on --port (mci router)",
    )
    max_engine_restarts: int = option(
        5, "restarts of a crashed engine within 10 minutes before it stays down (0: none)"
    )
    watchdog_timeout: float | None = option(
        None,
        "seconds the engine may go without progress before it is declared hung, killed and "
        "restarted (default: 30, or 10x the longest step it has taken if more)",
    )
    max_queue_time: float | None = option(
        120.0,
        "seconds a request may wait to be scheduled before it is refused with 503 and "
        "Retry-After (0: no bound)",
    )
    reasoning_parser: str | None = option(
        None,
        "chat: report the text before </think> as reasoning_content (DeepSeek-R1 style)",
        ["deepseek-r1"],
    )
    token_healing: bool = option(
        False,
        "completions and /generate: back off a prompt's last token(s) and let the model "
        "regenerate them (requests override with token_healing)",
    )
    tool_call_parser: str | None = option(
        None,
        "chat: the format tool calls are written in (default: deepseekv3 when the tokenizer "
        "has its markup tokens, else a JSON envelope)",
        ["deepseekv3", "json"],
    )
    otlp_traces_endpoint: str | None = option(
        None,
        "export OpenTelemetry traces over OTLP/HTTP to this URL (e.g. http://host:4318/v1/traces):"
        " a span per sample (queue, prefill, decode), joining the request's W3C traceparent",
    )

    def __post_init__(self):
        check_choices(self)
        problems = (
            (not 0 <= self.port <= 65535, "--port must be in 0..65535"),
            (self.dp_size < 1, "--dp-size must be >= 1"),
            (
                self.context_length is not None and self.context_length < 1,
                "--context-length must be >= 1",
            ),
            (self.max_queued_requests < 0, "--max-queued-requests must be >= 0"),
            (
                self.tenants is not None and self.api_key is not None,
                "--tenants replaces --api-key: give the key to a tenant in the file",
            ),
            (
                self.request_timeout is not None and not self.request_timeout > 0,
                "--request-timeout must be > 0",
            ),
            (self.drain_timeout < 0, "--drain-timeout must be >= 0"),
            (self.max_request_bytes < 1, "--max-request-bytes must be >= 1"),
            (not self.health_generate_timeout > 0, "--health-generate-timeout must be > 0"),
            (self.max_engine_restarts < 0, "--max-engine-restarts must be >= 0"),
            (
                self.watchdog_timeout is not None and self.watchdog_timeout < 1,
                "--watchdog-timeout must be >= 1 second (the engine beats every 0.5 s)",
            ),
            (
                self.max_queue_time is not None and self.max_queue_time < 0,
                "--max-queue-time must be >= 0 (0: no bound)",
            ),
        )
        for bad, why in problems:
            if bad:
                raise UserError(why)
