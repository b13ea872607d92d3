"""Prefill-decode disaggregation's settings, with SGLang's flag names."""

from __future__ import annotations

from dataclasses import dataclass

from mci.config_fields import check_choices, option
from mci.errors import UserError

MODES = ("null", "prefill", "decode")


@dataclass(frozen=True)
class DisaggregationConfig:
    """Which role this engine plays in a disaggregated pair, and how its KV travels."""

    disaggregation_mode: str = option(
        "null",
        "null: prefill and decode here (colocated); prefill: compute prompts and hand their KV "
        "and first token to a decode worker; decode: take prompts' KV from a prefill worker "
        "and decode (both serve colocated requests too; pair them with mci router "
        "--pd-disaggregation)",
        choices=MODES,
    )
    disaggregation_transfer_backend: str = option(
        "mooncake",
        "how KV moves between workers: mooncake (the Mooncake transfer engine: TCP, or RDMA "
        "with --disaggregation-ib-device)",
        choices=("mooncake",),
    )
    disaggregation_bootstrap_port: int = option(
        8998, "prefill worker: port of the bootstrap server decode workers handshake with"
    )
    disaggregation_host: str = option(
        "127.0.0.1",
        "address this worker's bootstrap server and transfer engine listen on and give peers",
    )
    disaggregation_ib_device: str | None = option(
        None, "RDMA device(s) for the transfer engine (e.g. mlx5_0); default: TCP"
    )
    disaggregation_transfer_timeout: float = option(
        10.0,
        "seconds a transfer may make no progress (the prefill side silent, a read stalled) "
        "before the request fails on the decode side and its slots are freed",
    )

    def __post_init__(self):
        check_choices(self)
        if not 0 <= self.disaggregation_bootstrap_port <= 65535:
            raise UserError("--disaggregation-bootstrap-port must be in 0..65535")
        if not self.disaggregation_transfer_timeout > 0:
            raise UserError("--disaggregation-transfer-timeout must be > 0")

    @property
    def enabled(self) -> bool:
        return self.disaggregation_mode != "null"
