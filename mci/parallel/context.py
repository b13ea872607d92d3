"""Who this process is in a parallel run, and the few collectives the model needs.

A run of W ranks (`--tp-size` / `--ep-size`, W the larger; all ranks in one torch.distributed
world, gloo on CPUs, NCCL on GPUs):

* tensor parallelism over tp_size ranks (tp_size is 1 or W): MLA heads, dense MLPs, shared
  experts, the vocabulary of embeddings and heads split; the latent KV cache replicated;
* expert parallelism over ep_size ranks (1 or W): routed experts split by expert. With
  ep_size 1 and tp_size W the routed experts are split like dense MLPs instead (each expert's
  intermediate dimension), as SGLang's TP MoE does;
* data-parallel attention (`dp_attention`, with ep_size W and tp_size 1): every rank runs its
  own requests through whole attention and dense layers, over its own KV cache, and the MoE
  layers exchange tokens with the ranks holding their experts (mci/parallel/dispatch.py).

Without data-parallel attention every rank sees every token of a step, so a sublayer whose
weights are split produces a partial sum, and one all-reduce per attention and per
feed-forward completes it. Sums run in float32
(the residual stream's dtype): partial outputs are not rounded to bf16 before they are added.
`ParallelContext.single()` is a run of one: every collective is the identity.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ParallelContext:
    rank: int
    world_size: int
    tp_size: int
    ep_size: int
    group: object = None  # the torch.distributed process group (None: a run of one)
    dp_attention: bool = False
    moe_dispatch: str = "all_to_all"  # under dp_attention: all_to_all | all_gather

    @classmethod
    def single(cls) -> ParallelContext:
        return cls(rank=0, world_size=1, tp_size=1, ep_size=1)

    @property
    def tp_rank(self) -> int:
        return self.rank if self.tp_size > 1 else 0

    @property
    def ep_rank(self) -> int:
        return self.rank if self.ep_size > 1 else 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's `x` (float32), on every rank, bitwise the same."""
        if self.world_size == 1:
            return x
        x = x.float().contiguous()
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather_columns(self, x: torch.Tensor) -> torch.Tensor:
        """[N, C] per tensor-parallel rank -> [N, tp_size * C], rank order (vocab-parallel
        logits)."""
        if self.tp_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.tp_size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def split(self, size: int, parts: int, index: int, what: str) -> tuple[int, int]:
        """[start, stop) of shard `index` of `parts` equal shards of `size` (a clear error when
        it does not divide)."""
        if size % parts:
            raise ValueError(f"{what} ({size}) does not divide into {parts} equal shards")
        step = size // parts
        return index * step, (index + 1) * step


# Joining takes as long as the slowest rank's start (a spawned interpreter importing torch on a
# loaded machine can take many seconds), so the rendezvous and the load agreement wait this long;
# serving collectives get --dist-timeout (a stuck rank must fail the others quickly).
START_TIMEOUT_S = 300.0


def init_process_group(
    rank: int, world_size: int, init_addr: str, timeout_s: float, device: str = "cpu"
) -> tuple[object, object]:
    """Join the run's torch.distributed world (gloo on CPUs, NCCL on GPUs). Returns (start
    group, serving group): the world, whose collectives wait up to START_TIMEOUT_S (rendezvous
    and the load agreement), and a group of the same ranks whose every collective times out
    after `timeout_s`, so a dead or stuck rank fails the others instead of hanging them."""
    backend = "nccl" if device.startswith("cuda") else "gloo"
    dist.init_process_group(
        backend,
        init_method=f"tcp://{init_addr}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=max(timeout_s, START_TIMEOUT_S)),
    )
    serving = dist.new_group(
        ranks=list(range(world_size)), timeout=datetime.timedelta(seconds=timeout_s)
    )
    return dist.group.WORLD, serving
