"""How the model is split over processes: SGLang's flag names (docs/parallel.md)."""

from __future__ import annotations

from dataclasses import dataclass

from mci.config_fields import check_choices, option
from mci.errors import UserError


@dataclass(frozen=True)
class ParallelConfig:
    """How the model is split over processes: tensor, expert and data-parallel attention ranks,
    over one or more machines."""

    tp_size: int = option(1, "tensor-parallel ranks (heads, MLPs, vocabulary)", aliases=("--tp",))
    ep_size: int = option(
        1, "expert-parallel ranks (routed experts split by expert)", aliases=("--ep",)
    )
    enable_dp_attention: bool = option(
        False,
        "data-parallel attention: each rank runs its own requests (own KV cache) through whole "
        "attention and dense layers; routed experts split over the ranks (needs --ep-size N)",
    )
    moe_dispatch: str = option(
        "all_to_all",
        "with --enable-dp-attention, how tokens reach their experts' ranks",
        ["all_to_all", "all_gather"],
    )
    nnodes: int = option(1, "machines the ranks span")
    node_rank: int = option(0, "this machine's index; node 0 serves, the others only compute")
    dist_init_addr: str | None = option(
        None, "host:port of node 0's rendezvous (default: a free local port; one node only)"
    )
    dist_timeout: float = option(
        30.0, "seconds a collective may wait for a peer before the run fails (dead/stuck rank)"
    )

    def __post_init__(self):
        check_choices(self)
        world = self.world_size
        for name, size in (("--tp-size", self.tp_size), ("--ep-size", self.ep_size)):
            if size < 1 or size not in (1, world):
                raise UserError(
                    f"{name} must be 1 or the number of ranks ({world}): tp and ep share them"
                )
        if self.nnodes < 1 or world % self.nnodes:
            raise UserError(f"--nnodes {self.nnodes} does not divide the {world} ranks")
        if not 0 <= self.node_rank < self.nnodes:
            raise UserError(f"--node-rank must be in [0, {self.nnodes})")
        if self.nnodes > 1 and not self.dist_init_addr:
            raise UserError("--nnodes > 1 needs --dist-init-addr HOST:PORT (node 0's)")
        if self.dist_timeout <= 0:
            raise UserError("--dist-timeout must be > 0")
        if self.enable_dp_attention and (self.tp_size != 1 or self.ep_size < 2):
            raise UserError(
                "--enable-dp-attention needs --ep-size N (N >= 2) and --tp-size 1: attention "
                "is data-parallel, the routed experts are split by expert"
            )

    @property
    def world_size(self) -> int:
        return max(self.tp_size, self.ep_size)

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nnodes
