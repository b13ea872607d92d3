"""Which part of each checkpoint tensor a rank loads (mci/parallel/context.py for the layout).

Each rank reads only its slice, through safetensors' memory map. Checkpoint names decide:

    vocabulary rows     embed_tokens, lm_head, shared_head.head          dim 0 over tp
    head rows           self_attn.q_b_proj / q_proj / kv_b_proj          dim 0 over tp
    head columns        self_attn.o_proj                                 dim 1 over tp
    intermediate rows   gate_proj / up_proj of dense MLPs, shared experts dim 0 over tp
    intermediate cols   their down_proj                                  dim 1 over tp
    routed experts      whole experts over ep; with ep 1, like a dense MLP over tp
    everything else     whole on every rank (norms, router, q_a/kv_a projections, eh_proj)

An FP8 weight's `weight_scale_inv` is sliced with it, in 128x128-block units. A shard boundary
inside a block would give one scale to rows of two ranks: that is refused with the tensor and
the row, not approximated.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from mci.parallel.context import ParallelContext

_EXPERT = re.compile(r"\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.")
_ROWS = re.compile(
    r"(embed_tokens|lm_head|shared_head\.head|self_attn\.(q_b_proj|q_proj|kv_b_proj)"
    r"|mlp\.(shared_experts\.)?(gate_proj|up_proj))\.weight"
)
_COLS = re.compile(r"(self_attn\.o_proj|mlp\.(shared_experts\.)?down_proj)\.weight")
SKIP = "skip"  # a routed expert another rank holds


@dataclass(frozen=True)
class Shard:
    """Indices [start, stop) along `dim` of the checkpoint tensor."""

    dim: int
    start: int
    stop: int


def expert_range(num_experts: int, parallel: ParallelContext) -> tuple[int, int]:
    """[first, stop) of the routed experts this rank holds."""
    if parallel.ep_size == 1:
        return 0, num_experts
    return parallel.split(num_experts, parallel.ep_size, parallel.ep_rank, "n_routed_experts")


def tensor_shard(
    name: str,
    weight_shape: tuple[int, ...],
    num_experts: int,
    parallel: ParallelContext,
    block: tuple[int, int] | None = None,
) -> Shard | str | None:
    """This rank's part of checkpoint tensor `name`: a Shard, None (whole) or SKIP.
    `weight_shape` is the (full) weight's shape, also for its `weight_scale_inv`; `block` the
    FP8 block size when `name` is a scale."""
    m = _EXPERT.search(name)
    if m and parallel.ep_size > 1:
        first, stop = expert_range(num_experts, parallel)
        return None if first <= int(m.group(1)) < stop else SKIP
    base = name.removesuffix("_scale_inv")
    if m:  # tensor parallelism inside each expert
        dim = 1 if m.group(2) == "down_proj" else 0
    elif _ROWS.search(base):
        dim = 0
    elif _COLS.search(base):
        dim = 1
    else:
        return None
    if parallel.tp_size == 1:
        return None
    start, stop = parallel.split(weight_shape[dim], parallel.tp_size, parallel.tp_rank, base)
    if block is None:
        return Shard(dim, start, stop)
    unit = block[dim]
    if start % unit or (stop % unit and stop != weight_shape[dim]):
        raise ValueError(
            f"--tp-size {parallel.tp_size} splits {base} at {'row' if dim == 0 else 'column'} "
            f"{start if start % unit else stop}, inside a {unit}-wide FP8 block; choose a "
            "tensor-parallel size whose shards are whole blocks"
        )
    return Shard(dim, start // unit, -(-stop // unit))


def local_expert(expert: int, num_experts: int, parallel: ParallelContext) -> int:
    return expert - expert_range(num_experts, parallel)[0]
