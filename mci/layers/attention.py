"""Multi-head latent attention (MLA) over a cache of compressed latents.

Per token the cache holds one row of `kv_lora_rank + qk_rope_head_dim` values:

    latent row = [ c_kv (kv_lora_rank, after kv_a_layernorm) | k_rope (qk_rope_head_dim, rotated) ]

Keys and values of every head are linear in c_kv:  k_nope_h = W_UK_h c_kv,  v_h = W_UV_h c_kv,
with kv_b_proj.weight = [W_UK_0; W_UV_0; W_UK_1; W_UV_1; ...] ([H*(nope+v), kv_lora]).
Two equivalent ways to attend:

* expanded: materialise k_nope and v for every context token and head, then ordinary
  attention. Cheap when many queries share a context (long prefills).
* absorbed: fold W_UK into the query (q_lat_h = W_UK_h^T q_nope_h), attend directly over the
  latent rows as one shared key/value "head" (MQA), then apply W_UV to the result. No per-token
  expansion: the right choice for decode, where one query faces a long context.

`choose_absorbed` picks the path with fewer multiply-adds, once per step for each attention
group (see attention_metadata.py): the decode group takes the absorbed path, a long fresh
prefill the expanded one. Both are tested equal.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from mci.kernels import cpu_kernels
from mci.layers.attention_metadata import AttentionGroup, AttentionMetadata
from mci.layers.linear import (
    BATCH_INVARIANT_ROWS,
    FP8_DTYPE,
    Linear,
    bucket_sizes,
    fixed_rows,
    make_linear,
    pad_rows,
)
from mci.layers.norm import RMSNorm
from mci.layers.rotary import apply_rope
from mci.model_config import ModelConfig
from mci.parallel.context import ParallelContext

# Batch-invariant attention without the CPU kernels pads each group's keys to a multiple of
# this (masked): SDPA's CPU kernel handles a key tail shorter than its 16-wide vectors apart,
# which changes a query's result with the padded length; over whole multiples of 16 it does
# not on an Intel CPU with AMX (measured: a query's output is bitwise the same for key lengths
# 16..2,048 padded from 7 or 300 real keys). On an AMD EPYC (avx512_bf16, no AMX) it still
# moved a row by a bf16 ulp with the chunk's query count, so with the CPU kernels every query
# row attends alone instead (`DeepseekV3ForCausalLM.attention_layout`).
ATTENTION_KEY_MULTIPLE = 16

# Batch-invariant attention with the CPU kernels: every sequence's rows join the decode group
# (one item per row, read in place by the decode kernel, whose sums run in one order per row
# whatever the step).
EVERY_ROW = 1 << 62

# With the CPU kernels, a sequence of up to this many new tokens (a speculative verification's
# k + 1 rows) attends in the decode group, each row read in place through the cache's slots,
# instead of as a prefill group of its own (a gathered [1, L, D] context and a masked SDPA
# call per sequence).
IN_PLACE_QUERY_ROWS = 8

# A prefill group whose sequences share at least this many cached context positions (the
# prefix-cache hit of a burst of requests on one system prompt) attends to that prefix once,
# for all of them, in the expanded form (cascade attention), then to each sequence's own rest,
# and merges the two by their log-sum-exps. Measured on the `small` model, 31 requests of 32
# new tokens after a shared 1,024-token prefix: see `_cascade`.
CASCADE_MIN_PREFIX = 256

# SDPA's backends on CUDA, cuDNN's left out: torch picks it first on Hopper, and it plans a
# cuDNN graph for every new shape. A decode step's context is one token longer each step, so
# every call planned anew: ~6.5 ms of host time a call against ~7 us of GPU time (an H200,
# torch 2.11: a `small` decode step took 78 ms, 8 of them per step). The flash and
# memory-efficient kernels plan nothing per shape; math is the fallback for what they refuse.
GPU_SDPA_BACKENDS = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs) -> torch.Tensor:
    """F.scaled_dot_product_attention, on CUDA restricted to `GPU_SDPA_BACKENDS`; elsewhere
    unchanged (the CPU's choice of kernel, and so its results, stay as they were)."""
    if q.device.type != "cuda":
        return F.scaled_dot_product_attention(q, k, v, **kwargs)
    with sdpa_kernel(list(GPU_SDPA_BACKENDS)):
        return F.scaled_dot_product_attention(q, k, v, **kwargs)


def choose_absorbed(cfg: ModelConfig, meta: AttentionMetadata | AttentionGroup) -> bool:
    """True when the absorbed path costs fewer multiply-adds than the expanded one, for a
    group (or a whole step, counted as one)."""
    h, c, r = cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    nope, v = cfg.qk_nope_head_dim, cfg.v_head_dim
    absorbed = meta.sum_query_len * h * c * (nope + v) + meta.sum_query_times_context * h * (
        2 * c + r
    )
    expanded = meta.sum_context * h * c * (nope + v) + meta.sum_query_times_context * h * (
        nope + r + v
    )
    return absorbed <= expanded


def decode_group(
    meta: AttentionMetadata, absorbed: tuple[bool, ...], rows: int
) -> AttentionGroup | None:
    """The step's one group when a step of `rows` rows is a decode the one-call kernels run
    (`MultiHeadLatentAttention.decode_in_one_call`): one group of rows 0..rows-1 in order,
    with context lengths, on the absorbed path; else None."""
    if len(meta.groups) != 1:
        return None
    group = meta.groups[0]
    if (
        group.lengths is None
        or not absorbed[0]
        or not isinstance(group.rows, slice)
        or group.rows != slice(0, rows)
    ):
        return None
    return group


@dataclass(frozen=True)
class _OneCallWeights:
    """A layer's weights as `cpu_kernels.CpuKernels.mla_decode` takes them (its MLAWeights)."""

    norm: tuple[torch.Tensor, float]
    qkv_a: cpu_kernels.KernelWeight
    q_dim: int
    q_norm: tuple[torch.Tensor, float] | None
    q_b: cpu_kernels.KernelWeight | None
    kv_norm: tuple[torch.Tensor, float]
    w_uk_t: cpu_kernels.KernelWeight
    w_uv: cpu_kernels.KernelWeight
    o: cpu_kernels.KernelWeight
    heads: int
    nope: int
    rope: int
    interleave: bool
    scale: float


class MultiHeadLatentAttention(nn.Module):
    """MLA with a latent KV cache; x: [T, hidden] -> [T, hidden]."""

    def __init__(
        self,
        cfg: ModelConfig,
        dtype: torch.dtype,
        fp8_block,
        parallel: ParallelContext | None = None,
    ):
        """Under tensor parallelism this rank holds heads [tp_rank * H/tp, ...): the head-wise
        rows of q_b_proj (q_proj) and kv_b_proj and the matching columns of o_proj; the latent
        projection and its cache are whole on every rank (MLA has one latent "head")."""
        super().__init__()
        self.parallel = parallel or ParallelContext.single()
        tp = self.parallel.tp_size
        if cfg.num_attention_heads % tp:
            raise ValueError(
                f"num_attention_heads ({cfg.num_attention_heads}) does not divide by tp {tp}"
            )
        self.num_heads = cfg.num_attention_heads // tp
        self.nope, self.rope_dim, self.v_dim = (
            cfg.qk_nope_head_dim,
            cfg.qk_rope_head_dim,
            cfg.v_head_dim,
        )
        self.kv_lora_rank = cfg.kv_lora_rank
        self.scale = cfg.softmax_scale
        self.interleave = cfg.rope_interleave
        h, hidden = self.num_heads, cfg.hidden_size
        # Both projections of the layer input run as one matmul: [q_a | kv_a] (or [q | kv_a]).
        self.q_lora_rank = cfg.q_lora_rank
        q_dim = h * cfg.qk_head_dim if cfg.q_lora_rank is None else cfg.q_lora_rank
        self.fused_qkv_a_proj = Linear(hidden, (q_dim, cfg.kv_latent_dim), dtype, fp8_block)
        if cfg.q_lora_rank is not None:
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps, dtype)
            self.q_b_proj = make_linear(cfg.q_lora_rank, h * cfg.qk_head_dim, dtype, fp8_block)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.rms_norm_eps, dtype)
        self.kv_b_proj = make_linear(
            cfg.kv_lora_rank, h * (self.nope + self.v_dim), dtype, fp8_block
        )
        self.o_proj = make_linear(h * self.v_dim, hidden, dtype, fp8_block)
        self._absorb_cache: dict[tuple[torch.dtype, bool], tuple[torch.Tensor | None, ...]] = {}
        self._head_segments: dict[int, torch.Tensor] = {}  # rows -> the kernels' segments
        self.fixed_rows: int | None = None  # rows per batched matmul, for batch invariance
        self._one_call: cpu_kernels.BoundMLA | None = None  # built on first use (below)

    def set_batch_invariant(self, enabled: bool) -> None:
        self.fixed_rows = BATCH_INVARIANT_ROWS if enabled else None
        for weights in self._absorb_cache.values():  # one kernel in batch invariance
            for kernel in weights[2:]:
                if isinstance(kernel, cpu_kernels.KernelWeight):
                    kernel.set_amx_rows(self._amx_rows())

    def _amx_rows(self) -> int:
        """The per-head kernel weights' `amx_rows`: the linears' (0 in batch invariance)."""
        matvec = self.kv_b_proj.matvec
        return 0 if self.fixed_rows is not None or matvec is None else matvec.amx_rows

    def _per_head(self, x: torch.Tensor, weights: torch.Tensor, rows_major):
        """x [N, H, a] @ weights [H, a, b] -> [N, H, b], one batched matmul over the heads, at
        bucketed row counts (or fixed ones: batch invariance). A few rows (decode) go through
        the CPU's skinny kernels instead, with the same weights laid out [H, b, a]
        (`rows_major`): each head is one "expert" of mci/kernels/cpu_kernels.py."""
        n, h, a = x.shape
        matvec = None if self.fixed_rows is not None else self.kv_b_proj.skinny(n)
        if matvec is not None:
            segments = self._head_segments.get(n)
            if segments is None:  # head h: rows h*N .. h*N + N - 1 of the head-major input
                heads = torch.arange(h)
                segments = self._head_segments[n] = torch.stack(
                    (heads, heads * n, torch.full((h,), n))
                )
            by_head = x.transpose(0, 1).reshape(h * n, a)  # [H*N, a], head-major
            out = matvec.expert_linear(by_head, rows_major, segments)
            return out.view(h, n, -1).transpose(0, 1)

        def bmm(rows: torch.Tensor) -> torch.Tensor:
            # float32 weights where bf16 is widened (layers/linear.py): the result rounded back
            out = torch.bmm(rows.transpose(0, 1).to(weights.dtype), weights)
            return out.transpose(0, 1).to(rows.dtype)

        if self.fixed_rows is not None:
            return fixed_rows(bmm, x, self.fixed_rows)
        return bmm(pad_rows(x))[: x.shape[0]]

    def forward(
        self,
        x: torch.Tensor,
        meta: AttentionMetadata,
        rope_cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_cache: torch.Tensor,
        absorbed: tuple[bool, ...],
    ) -> torch.Tensor:
        """x: [T, hidden]; kv_cache: [num_slots, kv_lora + rope] of this layer (written here);
        `absorbed`: the path of each of `meta.groups`."""
        t = x.shape[0]
        q, latent = self.fused_qkv_a_proj(x).split(self.fused_qkv_a_proj.part_sizes, dim=-1)
        if self.q_lora_rank is not None:
            q = self.q_b_proj(self.q_a_layernorm(q))
        q = q.view(t, self.num_heads, self.nope + self.rope_dim)
        q_nope, q_rope = q.split([self.nope, self.rope_dim], dim=-1)  # [T, H, nope], [T, H, rope]
        c_kv, k_rope = latent.split([self.kv_lora_rank, self.rope_dim], dim=-1)  # latent: [T, D]
        cos, sin = rope_cos_sin  # float32: rotations are computed in float32, rounded once
        kernels = self.kv_a_layernorm.kernels  # the CPU kernels, when the model runs on them
        if kernels is not None and q.dtype == kv_cache.dtype == torch.bfloat16:
            # the same values (the norm within float32 rounding) in two calls instead of ~25
            # small ops (tests/test_cpu_kernels.py)
            q_rope = kernels.rope_heads(q_rope, cos, sin, self.interleave)
            norm = self.kv_a_layernorm
            kernels.write_latent_rows(
                latent, norm.weight, norm.eps, cos, sin, self.interleave, kv_cache, meta.write_slots
            )
        else:
            q_rope = apply_rope(q_rope, cos[:, None], sin[:, None], self.interleave).to(q.dtype)
            k_rope = apply_rope(k_rope, cos, sin, self.interleave)  # rounded on the cache write
            c_kv = self.kv_a_layernorm(c_kv, k_rope.dtype)
            new_rows = torch.cat((c_kv, k_rope), dim=-1)  # [T, kv_lora + rope]
            kv_cache.index_copy_(0, meta.write_slots, new_rows.to(kv_cache.dtype))
        groups = meta.groups
        if len(groups) == 1 and isinstance(groups[0].rows, slice):  # rows are 0..T-1 in order
            out = self._attend(q_nope, q_rope, kv_cache, groups[0], absorbed[0])
        else:
            out = q_nope.new_empty(t, self.num_heads, self.v_dim)
            for group, group_absorbed in zip(groups, absorbed, strict=True):
                rows = group.rows
                out[rows] = self._attend(
                    q_nope[rows], q_rope[rows], kv_cache, group, group_absorbed
                )
        out = self.o_proj(out.reshape(t, self.num_heads * self.v_dim))
        return self.parallel.all_reduce(out) if self.parallel.tp_size > 1 else out

    def decode_in_one_call(
        self,
        x: torch.Tensor,
        norm: RMSNorm,
        meta: AttentionMetadata,
        rope_cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_cache: torch.Tensor,
        absorbed: tuple[bool, ...],
    ) -> torch.Tensor | None:
        """x + self(norm(x)) in one call of the CPU kernels (cpu_kernels.mla_decode: the same
        steps as `forward`'s kernel path, so the same values, ~25 torch ops fewer) for a step
        that is one decode group of a few rows on one process; None when the step is not
        such a step (the caller runs the sublayer as usual)."""
        t = x.shape[0]
        group = decode_group(meta, absorbed, t)
        if group is None or x.dtype != torch.float32 or kv_cache.dtype != torch.bfloat16:
            return None
        bound = self.bound_decode(t, norm)
        if bound is None:
            return None
        cos, sin = rope_cos_sin
        return bound(x, cos, sin, kv_cache, meta.write_slots, group.kv_slots, group.lengths)

    def bound_decode(self, rows: int, norm: RMSNorm) -> cpu_kernels.BoundMLA | None:
        """`decode_in_one_call`'s kernel call for a step of `rows` rows (float32 residual
        rows, a bf16 cache and a `decode_group`, which the caller checks), with this layer's
        weights bound once; None where the layer does not run on the kernels at that size."""
        matvec = self.kv_b_proj.skinny(rows)
        if (
            matvec is None
            or self.parallel.tp_size > 1
            or self.kv_lora_rank > cpu_kernels.MAX_LATENT
            or norm.kernels is None
            or self.fused_qkv_a_proj.skinny(rows) is None
            or self.o_proj.skinny(rows) is None
            or (self.q_lora_rank is not None and self.q_b_proj.skinny(rows) is None)
        ):
            return None
        if self._one_call is None:
            _, _, w_uk_t, w_uv = self._absorb_weights(torch.bfloat16)
            if w_uk_t is None or not torch.is_inference_mode_enabled():
                return None
            q_lora = self.q_lora_rank is not None
            self._one_call = matvec.bind_mla(
                _OneCallWeights(
                    norm=(norm.weight, norm.eps),
                    qkv_a=self.fused_qkv_a_proj.kernel,
                    q_dim=self.fused_qkv_a_proj.part_sizes[0],
                    q_norm=(self.q_a_layernorm.weight, self.q_a_layernorm.eps) if q_lora else None,
                    q_b=self.q_b_proj.kernel if q_lora else None,
                    kv_norm=(self.kv_a_layernorm.weight, self.kv_a_layernorm.eps),
                    w_uk_t=w_uk_t,
                    w_uv=w_uv,
                    o=self.o_proj.kernel,
                    heads=self.num_heads,
                    nope=self.nope,
                    rope=self.rope_dim,
                    interleave=self.interleave,
                    scale=self.scale,
                )
            )
        return self._one_call

    def _attend(self, q_nope, q_rope, kv_cache, group: AttentionGroup, absorbed: bool):
        """One group's attention: q_* [N, H, *] (N = B * Q rows) -> [N, H, v]."""
        if group.shared_prefix:
            return self._cascade(q_nope, q_rope, kv_cache, group)
        matvec = self.kv_b_proj.matvec
        if (
            absorbed
            and group.lengths is not None
            and matvec is not None
            and kv_cache.dtype == torch.bfloat16
            and self.kv_lora_rank <= cpu_kernels.MAX_LATENT
        ):
            return self._absorbed_decode_in_cache(matvec, q_nope, q_rope, kv_cache, group)
        b, length = group.kv_slots.shape
        context = kv_cache.index_select(0, group.kv_slots.view(-1)).view(b, length, -1)  # [B, L, D]
        q_nope = q_nope.view((b, group.query_len) + q_nope.shape[1:])  # [B, Q, H, nope]
        q_rope = q_rope.view((b, group.query_len) + q_rope.shape[1:])
        if absorbed:
            out = self._absorbed(q_nope, q_rope, context, group)
        else:
            out = self._expanded(q_nope, q_rope, context, group)
        return out.reshape((-1,) + out.shape[2:])  # [B*Q, H, v]

    def warm_up(self, max_rows: int) -> int:
        """Run the absorbed path's per-head matmuls at every row count a step of up to
        `max_rows` tokens gives them (see `DeepseekV3ForCausalLM.warm_up_cpu_kernels`)."""
        dtype = self.kv_b_proj.weight.dtype
        if dtype == FP8_DTYPE:
            return 0
        w_uk, w_uv_t, w_uk_t, w_uv = self._absorb_weights(dtype)
        sizes = [self.fixed_rows] if self.fixed_rows is not None else bucket_sizes(max_rows)
        for rows in sizes:
            x = w_uk.new_zeros(rows, self.num_heads, self.nope)
            self._per_head(self._per_head(x, w_uk, w_uk_t), w_uv_t, w_uv)
        return 2 * len(sizes)

    def _absorb_weights(self, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """W_UK [H, nope, kv_lora] and W_UV^T [H, kv_lora, v] of kv_b_proj, contiguous, as the
        absorbed path's bmms take them, then the same two as the skinny kernels take them
        (W_UK^T [H, kv_lora, nope], W_UV [H, v, kv_lora]; bf16 ones as KernelWeights that run
        on AMX from `amx_rows` rows, as the linears do). Under inference mode they are made
        once per dtype (weights do not change while serving; FP8 is dequantised once, not per
        step). The kernel layouts are None unless the CPU kernels run here; the bmm layouts
        are float32 where kv_b_proj's bf16 weight is widened (layers/linear.py)."""
        cache = self._absorb_cache
        kernels = self.kv_b_proj.matvec is not None  # the kernel layouts only where they run
        if (dtype, kernels) in cache:
            return cache[dtype, kernels]
        proj = self.kv_b_proj
        dense = proj.dense_weight(dtype)
        wide = proj.widened if dtype == proj.weight.dtype and proj.widened is not None else dense

        def heads(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # W_UK, W_UV
            w = weight.view(self.num_heads, self.nope + self.v_dim, -1)
            return w[:, : self.nope], w[:, self.nope :]

        (w_uk, w_uv), (k_uk, k_uv) = heads(wide), heads(dense)

        def for_kernels(weight: torch.Tensor):  # bf16: as a KernelWeight, AMX where it runs
            if dtype != torch.bfloat16:
                return weight
            kernel = cpu_kernels.KernelWeight(weight)
            kernel.set_amx_rows(self._amx_rows())
            return kernel

        weights = (
            w_uk.contiguous(),
            w_uv.transpose(1, 2).contiguous(),
            for_kernels(k_uk.transpose(1, 2).contiguous()) if kernels else None,
            for_kernels(k_uv.contiguous()) if kernels else None,
        )
        if torch.is_inference_mode_enabled():
            cache[dtype, kernels] = weights
        return weights

    def _absorbed(self, q_nope, q_rope, context, group: AttentionGroup) -> torch.Tensor:
        """q_*: [B, Q, H, *], context [B, L, D] -> [B, Q, H, v]."""
        b, q_len, h, _ = q_nope.shape
        length = context.shape[1]
        w_uk, w_uv_t, w_uk_t, w_uv = self._absorb_weights(q_nope.dtype)
        # q_lat[n, h] = W_UK_h^T q_nope[n, h]: [H, N, nope] @ [H, nope, kv_lora] -> [N, H, kv_lora]
        q_lat = self._per_head(q_nope.reshape(b * q_len, h, -1), w_uk, w_uk_t)
        q_full = torch.cat((q_lat, q_rope.reshape(b * q_len, h, -1)), dim=-1)  # [N, H, D]
        d = q_full.shape[-1]
        # All heads share the single latent key/value, so the Q*H (query, head) pairs attend as
        # one head of one fused SDPA call per sequence. The latent row is both key and value
        # (its last `rope` output columns are dropped); SDPA keeps scores and softmax in
        # float32, where separate bmms would round the scores to bf16 first.
        mask = group.mask
        if mask is not None:  # [B, Q, L] -> [B, 1, Q*H, L] (Q = 1: broadcast over the heads)
            if q_len == 1:
                mask = mask[:, None]
            else:
                m = mask.shape[0]  # 1 when the mask is shared by the group's sequences
                mask = mask[:, None, :, None].expand(-1, -1, -1, h, -1).reshape(m, 1, -1, length)
        kv = context[:, None]  # [B, 1, L, kv_lora + rope]
        out = sdpa(
            q_full.view(b, 1, q_len * h, d), kv, kv, attn_mask=mask, scale=self.scale
        )  # [B, 1, Q*H, kv_lora + rope]
        out_lat = out.view(b * q_len, h, d)[..., : self.kv_lora_rank]
        # out[n, h] = W_UV_h out_lat[n, h]: [H, N, kv_lora] @ [H, kv_lora, v] -> [N, H, v]
        out = self._per_head(out_lat, w_uv_t, w_uv)
        return out.reshape(b, q_len, h, self.v_dim)

    def _absorbed_decode_in_cache(self, matvec, q_nope, q_rope, kv_cache, group):
        """The absorbed path for the decode group with the CPU kernels: attention reads the
        latent rows in place through the group's slots (no gathered [B, L, D] copy of the
        contexts, no mask) -> [B, H, v]."""
        w_uk, w_uv_t, w_uk_t, w_uv = self._absorb_weights(q_nope.dtype)
        q_lat = self._per_head(q_nope, w_uk, w_uk_t)  # [B, H, kv_lora]
        q_full = torch.cat((q_lat, q_rope), dim=-1)  # [B, H, kv_lora + rope]
        # on AMX where the per-head weights are (the one-call step decides so: cpu_mla.c)
        out_lat = matvec.latent_decode_attention(
            q_full,
            kv_cache,
            group.kv_slots,
            group.lengths,
            self.kv_lora_rank,
            self.scale,
            amx=self._amx_rows() > 0,
        )
        return self._per_head(out_lat, w_uv_t, w_uv)

    def _expand(self, context: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Latent rows [..., kv_lora + rope] -> (keys [..., H, nope + rope], values [..., H, v])
        of every head."""
        c_kv, k_rope = context.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        kv = self.kv_b_proj(c_kv).view(c_kv.shape[:-1] + (self.num_heads, self.nope + self.v_dim))
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k_rope = k_rope.unsqueeze(-2).expand(k_rope.shape[:-1] + (self.num_heads, self.rope_dim))
        return torch.cat((k_nope, k_rope), dim=-1), v

    def _flash(self, q, k, v, is_causal: bool, mask=None):
        """CPU flash attention with its log-sum-exp: q/k/v [B, H, *, qk] (v zero-padded to
        qk by `_attend_prefill`) -> (out [B, H, Q, qk] in q's dtype, lse float32 [B, H, Q])."""
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, is_causal, attn_mask=mask, scale=self.scale
        )

    def _cascade(self, q_nope, q_rope, kv_cache, group: AttentionGroup) -> torch.Tensor:
        """Cascade attention for a group sharing its first P context positions: every query
        attends to the shared prefix in one call (keys and values expanded once: 160
        multiply-adds per query, key and head on `small` against the absorbed path's 288),
        each sequence's queries to its own positions P.. L-1 (masked as the group's), and the
        two partial results merge by their log-sum-exps in float32. q_* [N, H, *] (N = B*Q)
        -> [N, H, v]."""
        b, q_len, prefix = group.batch_size, group.query_len, group.shared_prefix
        qk = self.nope + self.rope_dim
        q = torch.cat((q_nope, q_rope), dim=-1)  # [N, H, qk]
        k, v = self._expand(kv_cache.index_select(0, group.kv_slots[0, :prefix]))  # [P, H, *]
        n = q.shape[0]
        out_p, lse_p = self._attend_prefill(
            q.transpose(0, 1)[None],
            k.transpose(0, 1)[None],
            v.transpose(0, 1)[None],
            torch.full((1, n), prefix, dtype=torch.long),
            causal=False,
            mask=None,
        )  # [1, H, N, v], [1, H, N]
        rest = group.kv_slots[:, prefix:]  # [B, L' ] (pad keys masked)
        context = kv_cache.index_select(0, rest.reshape(-1)).view(b, rest.shape[1], -1)
        k, v = self._expand(context)  # [B, L', H, *]
        out_r, lse_r = self._attend_prefill(
            q.view(b, q_len, self.num_heads, qk).transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            group.key_limits - prefix,
            causal=rest.shape[1] == q_len,  # the rest is the new tokens: plain causal
            mask=group.mask[:, None, :, prefix:],
        )  # [B, H, Q, v], [B, H, Q]
        lse_p = lse_p[0].transpose(0, 1)  # [N, H]
        lse_r = lse_r.transpose(1, 2).reshape(b * q_len, self.num_heads)
        top = torch.maximum(lse_p, lse_r)
        w_p, w_r = (lse_p - top).exp(), (lse_r - top).exp()
        kernels = self._prefill_kernels(q)
        if kernels is not None:  # the lines below in one pass, bit for bit
            return kernels.merge_partials(out_p, out_r, w_p, w_r)
        out_p = out_p[0].transpose(0, 1)  # [N, H, v]
        out_r = out_r.transpose(1, 2).reshape(b * q_len, self.num_heads, -1)
        out = out_p.float() * w_p[..., None] + out_r.float() * w_r[..., None]
        out = out / (w_p + w_r)[..., None]
        return out.to(q_nope.dtype)

    def _prefill_kernels(self, q: torch.Tensor):
        """The CPU kernels when prefill attention runs on them (bf16 on the CPU), else None."""
        kernels = self.kv_a_layernorm.kernels
        if kernels is None or q.dtype != torch.bfloat16 or q.device.type != "cpu":
            return None
        if kernels.isa == "avx2":  # measured slower than the flash kernel there (2.3x at 2k)
            return None
        return kernels if q.shape[-1] % 2 == 0 else None

    def _attend_prefill(self, q, k, v, limits, causal: bool, mask):
        """q [B, H, Q, qk], k [B, H, L, qk], v [B, H, L, v] -> (out [B, H, Q, v], log-sum-exp
        float32 [B, H, Q]); row r of sequence b sees keys 0 .. limits[b or 0, r] - 1, which
        `causal` or the bool `mask` ([B or 1, 1, Q, L]) also say, for the flash kernel. On
        the CPU kernels (bf16): their prefill attention, ~2.6x the flash kernel's speed at
        1,056 tokens on an AMD EPYC (see cpu_prefill_attention.c); on AMX tiles where the CPU
        has them, except in batch invariance, which keeps the vdpbf16ps path's bits."""
        kernels = self._prefill_kernels(q)
        if kernels is not None:
            amx = self.fixed_rows is None
            return kernels.prefill_attention(q, k, v, limits, self.scale, amx)
        qk = q.shape[-1]
        if self.v_dim < qk:  # SDPA's fused kernels need equal head dims
            v = F.pad(v, (0, qk - self.v_dim))
        additive = None
        if not causal and mask is not None:  # the flash kernel takes an additive mask
            additive = torch.zeros(mask.shape, dtype=q.dtype, device=q.device)
            additive.masked_fill_(~mask, float("-inf"))
        out, lse = self._flash(q, k, v, causal, additive)
        return out[..., : self.v_dim], lse

    def _expanded(self, q_nope, q_rope, context, group: AttentionGroup) -> torch.Tensor:
        """q_*: [B, Q, H, *], context [B, L, D] -> [B, Q, H, v]."""
        k, v = self._expand(context)  # [B, L, H, nope + rope], [B, L, H, v]
        q = torch.cat((q_nope, q_rope), dim=-1)  # [B, Q, H, nope + rope]
        if group.key_limits is not None and self._prefill_kernels(q) is not None:
            mask = None if group.mask is None else group.mask[:, None]
            out, _ = self._attend_prefill(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), group.key_limits,
                group.causal, mask,
            )  # fmt: skip
            return out.transpose(1, 2)  # [B, Q, H, v]
        if self.v_dim < q.shape[-1]:  # SDPA's fused kernels need equal head dims
            v = F.pad(v, (0, q.shape[-1] - self.v_dim))
        # [B, 1, Q, L]; a fresh sequence uses SDPA's own causal mode (its fastest kernel)
        mask = None if group.causal or group.mask is None else group.mask[:, None]
        out = sdpa(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=mask,
            is_causal=group.causal,
            scale=self.scale,
        )  # [B, H, Q, qk_dim]
        return out.transpose(1, 2)[..., : self.v_dim]  # [B, Q, H, v]
