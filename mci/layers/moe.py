"""DeepSeekMoE: a sigmoid router with group-limited top-k, batched routed experts, shared experts.

Routing (DeepSeek-V3, `topk_method="noaux_tc"`):
  scores      = sigmoid(x W_gate^T)                       [T, E], float32
  choice      = scores + e_score_correction_bias          bias picks experts, never weights them
  group score = sum of the top-2 `choice` values in each of `n_group` groups
  keep the `topk_group` best groups, take the top `num_experts_per_tok` experts inside them
  weights     = scores at the chosen experts, / their sum if `norm_topk_prob`,
                times `routed_scaling_factor`
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mci.kernels import cpu_kernels
from mci.layers.linear import (
    BATCH_INVARIANT_ROWS,
    Linear,
    bucket_rows,
    bucket_sizes,
    can_pack,
    empty_rows,
    pack_weight,
    packed_linear,
)
from mci.layers.mlp import GatedMLP
from mci.model_config import ModelConfig
from mci.parallel.context import ParallelContext
from mci.parallel.dispatch import dispatch


class TopKRouter(nn.Module):
    """Chooses experts per token; the gate weight and bias are kept in float32."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_experts = cfg.n_routed_experts
        self.top_k = cfg.num_experts_per_tok
        self.n_group, self.topk_group = cfg.n_group, cfg.topk_group
        self.norm_topk_prob = cfg.norm_topk_prob
        self.scaling = cfg.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size), False)
        self.e_score_correction_bias = nn.Parameter(torch.zeros(cfg.n_routed_experts), False)
        self._packed: torch.Tensor | None = None
        self._fixed_rows: int | None = None

    def set_batch_invariant(self, enabled: bool) -> None:
        """With `enabled`, score through oneDNN's packed float32 matmul, which computes each
        row as it would alone at any row count; aten's float32 matmul (MKL) does not for 2+
        rows, and a last-bit change in a score can flip a near-tied expert choice."""
        if enabled and not can_pack(self.weight):
            raise ValueError("batch-invariant routing needs oneDNN on the CPU")
        self._packed = pack_weight(self.weight) if enabled else None
        self._fixed_rows = BATCH_INVARIANT_ROWS if enabled else None

    @property
    def bias(self) -> torch.Tensor:
        return self.e_score_correction_bias

    @property
    def batch_invariant(self) -> bool:
        return self._packed is not None

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, hidden] -> float32 [T, E], the gate's matmul (in float32)."""
        if self._packed is not None:
            return packed_linear(x.float(), self._packed, self._fixed_rows)
        return F.linear(x.float(), self.weight)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, hidden] -> (weights [T, K] float32, expert ids [T, K] int64)."""
        scores = self.logits(x).sigmoid()  # [T, E]
        choice = scores + self.e_score_correction_bias
        if self.n_group > 1:
            grouped = choice.view(x.shape[0], self.n_group, -1)  # [T, G, E/G]
            group_scores = grouped.topk(2, dim=-1).values.sum(-1)  # [T, G]
            keep = group_scores.topk(self.topk_group, dim=-1, sorted=False).indices
            group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
            choice = grouped.masked_fill(~group_mask[..., None], float("-inf")).view_as(choice)
        ids = choice.topk(self.top_k, dim=-1, sorted=False).indices  # [T, K]
        weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * self.scaling, ids


class RoutedExperts(nn.Module):
    """All routed experts. Tokens are sorted by expert, then either

    * looped: one matmul pair per *active* expert (never per token) — reads only the weights
      of the experts in use, the right choice when few are (a decode step of a few requests);
    * skinny: the loop's work in two calls of the CPU kernels (mci/kernels/), when no
      active expert has more than the kernels' `expert_max_rows` tokens (decode steps of up
      to ~48 requests); taken first wherever it runs;
    * grouped: every expert's tokens padded to a common count and run as two batched matmuls
      over all experts — two calls instead of two per expert, the right choice when most
      experts are in use anyway (a batch of decodes, a prefill), where the loop's per-call
      overhead costs more than the matmuls.

    In bf16 the grouped and looped paths agree bitwise up to 16 rows per expert (tested); with
    more rows the batched matmul may round a row's last bit differently from the looped one
    (seen at 32 rows on a 512x512 expert), as the skinny kernels may. So which path a token
    took can move its output by a bf16 ulp; `--deterministic` always loops, one kernel for
    every step. float32 (aten's MKL kernels: they disagree) and FP8 weights always loop.
    """

    # Grouped when at least this share of the experts is active, padding at most triples the
    # rows, and no expert has more than GROUPED_MAX_ROWS tokens. Measured on the `small`
    # model (32 experts, bf16, 2 threads, kernels warmed up), one MoE layer looped vs grouped:
    # 128 tokens 14.5 vs 5.7 ms, 266 tokens 17.7 vs 9.0, 512 tokens 20.8 vs 12.2 (the loop's
    # per-expert matmuls of a few dozen rows are slow in oneDNN); whole steps, alternating in
    # one process: 256-token prefill + 10 decodes 157 vs 123 ms, but a 1,056-token prefill
    # (~256 rows per expert) 200-260 vs 215-325 ms, so grouping stops at 160 rows per expert.
    GROUPED_MIN_ACTIVE = 0.5
    GROUPED_MAX_PADDING = 3.0
    GROUPED_MAX_ROWS = 160
    WARM_UP_MAX_BYTES = 1 << 30  # a layer's experts larger than this are not warmed up

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, fp8_block, parallel: ParallelContext):
        """Under expert parallelism this rank holds experts [first, first + E/ep); under
        tensor parallelism alone, every expert's intermediate rows 1/tp (SGLang's TP MoE). The
        output is then a partial sum (MoE all-reduces it)."""
        super().__init__()
        e, h, i = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.total_experts = e
        if parallel.ep_size > 1:
            first, stop = parallel.split(e, parallel.ep_size, parallel.ep_rank, "n_routed_experts")
            self.first_expert, e = first, stop - first
        else:
            self.first_expert = 0
            if i % parallel.tp_size:
                raise ValueError(
                    f"moe_intermediate_size ({i}) does not divide by tp {parallel.tp_size}"
                )
            i //= parallel.tp_size
        self.num_experts = e
        self.gate_up_proj = Linear(h, (i, i), dtype, fp8_block, num_experts=e)  # [E, 2I, H]
        self.down_proj = Linear(i, (h,), dtype, fp8_block, num_experts=e)  # [E, H, I]
        self.grouped = True  # off for batch invariance: one kernel per expert, the loop's
        # (gate_up, down) packed for the AMX kernels (cpu_amx.c), where they run: MoE's
        # one-call path, on one process only
        self.amx: tuple[torch.Tensor, torch.Tensor] | None = None
        self.single_process = parallel.world_size == 1

    def pack_for_cpu(self, kernels) -> None:
        """With the CPU kernels (a `cpu_kernels.CpuKernels`, or None), keep AMX-packed
        copies of the experts' weights where the AMX kernels run (one more copy of them)."""
        self.amx = None
        if kernels is None or not kernels.amx or not self.single_process:
            return
        packed = [
            kernels.amx_pack(self.gate_up_proj.weight, gated=True),
            kernels.amx_pack(self.down_proj.weight),
        ]
        if all(p is not None for p in packed):
            self.amx = (packed[0], packed[1])

    def set_batch_invariant(self, enabled: bool) -> None:
        self.grouped = not enabled

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x: [T, H], weights/ids: [T, K] -> sum_k weights[t,k] * expert_{ids[t,k]}(x[t]),
        float32 [T, H]."""
        top_k = ids.shape[1]
        flat_ids = ids.flatten()  # [T*K]
        order = flat_ids.argsort(stable=True)  # assignments grouped by expert
        counted = flat_ids
        if self.num_experts < self.total_experts:  # expert parallelism: this rank's experts
            flat_ids = flat_ids - self.first_expert  # in this rank's numbering
            sorted_ids = flat_ids[order]
            order = order[(sorted_ids >= 0) & (sorted_ids < self.num_experts)]
            counted = flat_ids[order]
        token_idx = order // top_k  # [T*K] token of each sorted assignment
        counts = torch.bincount(counted, minlength=self.num_experts)
        x_sorted = x.index_select(0, token_idx)  # [T*K, H] (index_select: ~4x aten's x[idx])
        counts_list = counts.tolist()
        if not order.numel():
            return x.new_zeros(x.shape, dtype=torch.float32)
        matvec = self.gate_up_proj.skinny(max(counts_list), expert_rows=True)
        if matvec is not None:
            sorted_weights = weights.flatten()[order]
            return self._skinny(matvec, x_sorted, counts_list, token_idx, sorted_weights, len(x))
        capacity = bucket_rows(max(counts_list))
        active = sum(1 for c in counts_list if c)
        if (
            self.grouped
            and self.gate_up_proj.weight.dtype == torch.bfloat16  # where agreement is tested
            and active >= self.GROUPED_MIN_ACTIVE * self.num_experts
            and capacity <= self.GROUPED_MAX_ROWS
            and capacity * self.num_experts <= self.GROUPED_MAX_PADDING * len(order)
        ):
            out_sorted = self._grouped(x_sorted, flat_ids[order], counts, capacity)
        else:
            out_sorted = self._looped(x_sorted, counts_list)
        # Weighted and summed in float32 (one rounding fewer per expert output than bf16).
        scaled = out_sorted.float() * weights.flatten()[order, None]
        return x.new_zeros(x.shape, dtype=torch.float32).index_add_(0, token_idx, scaled)

    def _looped(self, x_sorted: torch.Tensor, counts: list[int]) -> torch.Tensor:
        out_sorted = torch.empty_like(x_sorted)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            seg = x_sorted[start : start + count]
            gate, up = self.gate_up_proj(seg, expert).chunk(2, dim=-1)
            out_sorted[start : start + count] = self.down_proj(F.silu(gate) * up, expert)
            start += count
        return out_sorted

    def _skinny(self, matvec, x_sorted, counts, token_idx, sorted_weights, num_tokens: int):
        """The loop's result in two kernel calls (mci/kernels/cpu_kernels.py): every active
        expert's few rows, each call reading only the active experts' weights; the second also
        weights and sums the outputs per token, as `forward` does for the other paths (the
        same float32 operations in the same order). -> float32 [T, H]."""
        ids = [e for e, c in enumerate(counts) if c]
        sizes = [counts[e] for e in ids]
        starts = [0]
        for c in sizes[:-1]:
            starts.append(starts[-1] + c)
        segments = torch.tensor([ids, starts, sizes], dtype=torch.long)
        gate, up = matvec.expert_linear(x_sorted, self.gate_up_proj.kernel, segments).chunk(2, -1)
        out = torch.zeros(num_tokens, self.down_proj.out_features, dtype=torch.float32)
        return matvec.expert_linear_combine(
            F.silu(gate) * up, self.down_proj.kernel, segments, token_idx, sorted_weights, out
        )

    def warm_up(self) -> int:
        """Run the grouped path's batched matmuls at every capacity it uses (see
        `DeepseekV3ForCausalLM.warm_up_cpu_kernels`); nothing when it never runs."""
        if not self.grouped or self.gate_up_proj.weight.dtype != torch.bfloat16:
            return 0
        weights = self.gate_up_proj.weight, self.down_proj.weight
        if sum(w.numel() * w.element_size() for w in weights) > self.WARM_UP_MAX_BYTES:
            return 0  # each call reads every expert: there the matmul dwarfs its compile
        hidden = self.gate_up_proj.in_features
        capacities = bucket_sizes(self.GROUPED_MAX_ROWS)
        for capacity in capacities:
            x = self.gate_up_proj.weight.new_zeros(capacity, hidden)
            ids = torch.zeros(capacity, dtype=torch.long)
            counts = torch.zeros(self.num_experts, dtype=torch.long)
            counts[0] = capacity
            self._grouped(x, ids, counts, capacity)
        return 2 * len(capacities)

    def _grouped(self, x_sorted, sorted_ids, counts, capacity: int) -> torch.Tensor:
        """x_sorted [A, H] (A assignments, sorted by expert) -> expert outputs [A, H]."""
        # Row of each assignment inside its expert's padded block.
        first = torch.cumsum(counts, 0) - counts  # [E] first sorted assignment of each expert
        pos = torch.arange(len(sorted_ids), device=x_sorted.device) - first[sorted_ids]
        blocks = x_sorted.new_zeros(self.num_experts, capacity, x_sorted.shape[1])
        blocks[sorted_ids, pos] = x_sorted
        w_gate_up, w_down = self.gate_up_proj.matmul_weight(), self.down_proj.matmul_weight()
        gate_up = torch.bmm(blocks.to(w_gate_up.dtype), w_gate_up.transpose(1, 2))  # [E, C, 2I]
        gate, up = gate_up.to(x_sorted.dtype).chunk(2, dim=-1)
        hidden = (F.silu(gate) * up).to(w_down.dtype)
        out = torch.bmm(hidden, w_down.transpose(1, 2)).to(x_sorted.dtype)  # [E, C, H]
        return out[sorted_ids, pos]


class MoE(nn.Module):
    """Routed experts plus always-on shared experts; x: [T, hidden] -> float32 [T, hidden].

    On one process with the CPU kernels, the whole block after the router's matmul is one call
    (mci/kernels/cpu_moe.c: the same operations as below, about 45 small torch ops fewer per
    layer): its experts on the skinny kernels when they get at most the kernels'
    `expert_max_rows` tokens, busier ones (prefill chunks) on AMX tiles where the CPU has AMX,
    else on the AVX-512 build's GEMM (cpu_gemm.c; FP8 experts widened by cpu_fp8.c). The
    shared experts run inside the call at row counts their linears take the kernels with
    (`Linear.skinny`: up to 64 rows, bf16 on AMX up to 512); past that, bf16 weights of up to
    AMX_PACKED_WEIGHT_BYTES on a CPU with AMX, on the routed experts' AMX kernel as one more
    expert of every token (`shared_amx`: the sums the shared linears' own packed AMX path
    gives, added in the call; at any row count: measured level with oneDNN at 2,048 rows and
    faster at 4,096, unlike a lone linear); else below as usual. The AVX2 build has no GEMM:
    a step with a busy expert falls back to the paths below, fed the routing the call
    computed.

    Takes its input in float32 (the decoder layer's norm skips rounding it): routing is a
    discrete choice, and near-ties between experts flip on the rounding of the router's input,
    which moves a token's logprob by a lot more than any other rounding. The router reads the
    unrounded input; the experts get it rounded to the compute dtype once.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        dtype: torch.dtype,
        fp8_block,
        parallel: ParallelContext | None = None,
    ):
        super().__init__()
        self.dtype = dtype
        self.parallel = parallel = parallel or ParallelContext.single()
        self.gate = TopKRouter(cfg)  # whole on every rank: every rank routes alike
        self.experts = RoutedExperts(cfg, dtype, fp8_block, parallel)
        self.shared_experts = None
        if cfg.n_shared_experts:
            inter = cfg.moe_intermediate_size * cfg.n_shared_experts
            self.shared_experts = GatedMLP(
                cfg.hidden_size, inter, dtype, fp8_block, shards=parallel.tp_size
            )
        # the shared experts packed for the AMX expert kernels (gate_up, down), where they run
        # (`pack_shared_for_cpu`): inside the one-call MoE at steps past their own linears'
        # bound on the kernels
        self.shared_amx: tuple[torch.Tensor, torch.Tensor] | None = None
        # the one-call kernels' bound calls (cpu_kernels.BoundMoE), by where the shared
        # experts run inside the call ("kernels", "amx" or None: not inside); made on first
        # use, after the weights are packed
        self._bound: dict[str | None, cpu_kernels.BoundMoE] = {}

    def pack_shared_for_cpu(self, kernels) -> None:
        """After the model's linears and experts are packed (`pack_for_cpu`), with the CPU
        kernels (a `cpu_kernels.CpuKernels`, or None): where the shared experts' linears run
        past their kernel rows on AMX (`Linear.amx_packed`), their gate_up packed again with
        gate and up interleaved for the call (in place of its plain packed copy, which the
        call then makes unused; the down projection's is shared). Clears the bound calls,
        which hold the packed weights they were made with."""
        self.shared_amx, self._bound = None, {}
        shared = self.shared_experts
        if kernels is None or shared is None or self.parallel.world_size > 1:
            return
        gate_up, down = shared.gate_up_proj, shared.down_proj
        if gate_up.amx_packed is None or down.amx_packed is None:
            return
        gated = kernels.amx_pack(gate_up.weight[None], gated=True)
        if gated is not None:
            self.shared_amx = (gated, down.amx_packed)
            gate_up.amx_packed = None

    def bound_call(self, rows: int) -> tuple[cpu_kernels.BoundMoE, bool] | None:
        """The whole block as one call of the CPU kernels for `rows` float32 rows, its weights
        bound once, and whether the shared experts run inside it (else the caller adds them);
        None when the block does not run that way at that size (see above)."""
        matvec = self.experts.gate_up_proj.skinny(1)
        if (
            matvec is None
            or self.parallel.world_size > 1
            or (rows > matvec.max_rows and self.experts.amx is None and not matvec.gemm)
            or self.gate.batch_invariant  # the gate's own kernel, row by row
        ):
            return None
        shared = self.shared_experts
        where = None
        if shared is not None and all(
            p.skinny(rows) is not None for p in (shared.gate_up_proj, shared.down_proj)
        ):
            where = "kernels"  # their linears' own kernels (in-place AMX up to their bound)
        elif shared is not None and self.shared_amx is not None:
            where = "amx"  # past that bound: the expert kernel, not after the call
        bound = self._bound.get(where)
        if bound is None:  # the block's fixed arguments, converted once
            bound = self._bound[where] = matvec.bind_moe(
                self.gate,
                (self.experts.gate_up_proj.kernel, self.experts.down_proj.kernel),
                self.experts.amx,
                (shared.gate_up_proj.kernel, shared.down_proj.kernel)
                if where == "kernels"
                else None,
                matvec.expert_max_rows,
                self.shared_amx if where == "amx" else None,
            )
        return bound, where is not None or shared is None

    def idle(self) -> None:
        """Take part in the token exchange with no tokens (data-parallel attention: a rank
        without work this step; the others' collectives need it)."""
        hidden, k = self.gate.weight.shape[1], self.gate.top_k
        x = torch.empty(0, hidden, dtype=self.dtype)
        weights, ids = torch.empty(0, k), torch.empty(0, k, dtype=torch.long)
        dispatch(self.experts, x, weights, ids, self.parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """One all-reduce in a parallel run: of routed + shared when both are partial sums
        (tensor parallelism), of the routed part alone when the shared experts are whole on
        every rank (expert parallelism without tensor parallelism)."""
        one_call = self.bound_call(x.shape[0]) if x.dtype == torch.float32 else None
        if one_call is not None:  # a few tokens on one process: the whole block in one call
            bound, whole = one_call
            out, weights, ids = bound(x, self.gate.logits(x))
            if out is not None:
                if whole:
                    return out
                # x rounded to the model dtype, with room for the shared experts' bucketed rows
                xb = empty_rows(*x.shape, dtype=self.dtype, device=x.device).copy_(x)
                return out + self.shared_experts(xb)
        else:
            weights, ids = self.gate(x)
        x = x.to(self.dtype)
        if self.parallel.dp_attention:  # this rank's own tokens; shared experts whole here
            out = dispatch(self.experts, x, weights, ids, self.parallel)
            return out if self.shared_experts is None else out + self.shared_experts(x)
        out = self.experts(x, weights, ids)
        shared = None if self.shared_experts is None else self.shared_experts(x)
        if self.parallel.world_size == 1:
            return out if shared is None else out + shared
        if self.parallel.tp_size > 1:
            return self.parallel.all_reduce(out if shared is None else out + shared)
        out = self.parallel.all_reduce(out)
        return out if shared is None else out + shared
