"""Routed experts under data-parallel attention: each rank brings its own tokens to the MoE
layer, the experts are split across ranks, and every token's K expert outputs must come back to
the rank that owns the token. Two ways to move them (both exact: the same expert outputs,
summed in float32):

* `all_gather`: every rank gathers every rank's tokens (padded to the largest count), runs its
  own experts over all of them, and a reduce-scatter returns each rank the sum over ranks for
  its tokens. Two collectives of fixed shape; moves every token to every rank.
* `all_to_all`: each (token, expert) assignment is sent only to the rank holding that expert,
  computed there, and sent back; the owner sums its token's K results. Moves each token K
  times at most, in four collectives (counts, then data there and back).

A rank with no tokens this step still takes part (`idle`): the collectives need every rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mci.parallel.context import ParallelContext

DISPATCHES = ("all_gather", "all_to_all")


def dispatch(
    experts, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, parallel: ParallelContext
) -> torch.Tensor:
    """x [n, H] (this rank's tokens), weights/ids [n, K] -> float32 [n, H]: the sum of each
    token's K weighted expert outputs, whichever ranks hold them."""
    if parallel.moe_dispatch == "all_gather":
        return _all_gather(experts, x, weights, ids, parallel)
    return _all_to_all(experts, x, weights, ids, parallel)


def _counts(n: int, parallel: ParallelContext) -> list[int]:
    counts = torch.zeros(parallel.world_size, dtype=torch.long)
    dist.all_gather_single(counts, torch.tensor([n]), group=parallel.group)
    return counts.tolist()


def _all_gather(experts, x, weights, ids, parallel: ParallelContext) -> torch.Tensor:
    n, world = x.shape[0], parallel.world_size
    rows = max(_counts(n, parallel))
    if rows == 0:
        return x.new_zeros(x.shape, dtype=torch.float32)
    pad = rows - n
    # one float32 message per rank: [x | weights | ids] (ids exact in float32: < 2^24)
    packed = torch.cat((x.float(), weights.float(), ids.float()), dim=1)
    packed = torch.cat((packed, packed.new_zeros(pad, packed.shape[1])))
    packed[n:, -ids.shape[1] :] = -1  # padding rows route to no expert
    gathered = packed.new_empty(world * rows, packed.shape[1])
    dist.all_gather_single(gathered, packed, group=parallel.group)
    h, k = x.shape[1], ids.shape[1]
    all_x = gathered[:, :h].to(x.dtype)
    all_w, all_ids = gathered[:, h : h + k], gathered[:, h + k :].long()
    partial = experts(all_x, all_w, all_ids)  # [world * rows, H]: this rank's experts only
    mine = partial.new_empty(rows, h)
    dist.reduce_scatter_single(mine, partial.contiguous(), group=parallel.group)
    return mine[:n]


def _all_to_all(experts, x, weights, ids, parallel: ParallelContext) -> torch.Tensor:
    n, k, h = x.shape[0], ids.shape[1], x.shape[1]
    per_rank = experts.total_experts // parallel.world_size
    owner = (ids // per_rank).flatten()  # [n*K] rank holding each assignment's expert
    order = owner.argsort(stable=True)
    send_counts = torch.bincount(owner, minlength=parallel.world_size)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=parallel.group)
    send, recv = send_counts.tolist(), recv_counts.tolist()
    token = order // k
    packed = torch.cat(
        (x.float()[token], weights.flatten()[order, None].float(), ids.flatten()[order, None]),
        dim=1,
    )  # [n*K, H + 2]: one row per assignment, sorted by destination rank
    arrived = packed.new_empty(sum(recv), h + 2)
    dist.all_to_all_single(arrived, packed, recv, send, group=parallel.group)
    if arrived.shape[0]:
        done = experts(
            arrived[:, :h].to(x.dtype), arrived[:, h : h + 1], arrived[:, h + 1 :].long()
        )
    else:
        done = arrived.new_zeros(0, h)
    back = done.new_empty(n * k, h)
    dist.all_to_all_single(back, done.contiguous(), send, recv, group=parallel.group)
    return x.new_zeros((n, h), dtype=torch.float32).index_add_(0, token, back)
