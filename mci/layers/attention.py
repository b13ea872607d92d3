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

`choose_absorbed` picks the path with fewer multiply-adds for the step; both are tested equal.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mci.config import ModelConfig
from mci.layers.attention_metadata import AttentionMetadata
from mci.layers.linear import Linear, make_linear
from mci.layers.norm import RMSNorm
from mci.layers.rotary import apply_rope


def choose_absorbed(cfg: ModelConfig, meta: AttentionMetadata) -> bool:
    """True when the absorbed path costs fewer multiply-adds than the expanded one."""
    h, c, r = cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    nope, v = cfg.qk_nope_head_dim, cfg.v_head_dim
    absorbed = meta.sum_query_len * h * c * (nope + v) + meta.sum_query_times_context * h * (
        2 * c + r
    )
    expanded = meta.sum_context * h * c * (nope + v) + meta.sum_query_times_context * h * (
        nope + r + v
    )
    return absorbed <= expanded


class MultiHeadLatentAttention(nn.Module):
    """MLA with a latent KV cache; x: [T, hidden] -> [T, hidden]."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, fp8_block):
        super().__init__()
        self.num_heads = cfg.num_attention_heads
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

    def forward(
        self,
        x: torch.Tensor,
        meta: AttentionMetadata,
        rope_cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_cache: torch.Tensor,
        absorbed: bool,
    ) -> torch.Tensor:
        """x: [T, hidden]; kv_cache: [num_slots, kv_lora + rope] of this layer (written here)."""
        t = x.shape[0]
        q, latent = self.fused_qkv_a_proj(x).split(self.fused_qkv_a_proj.part_sizes, dim=-1)
        if self.q_lora_rank is not None:
            q = self.q_b_proj(self.q_a_layernorm(q))
        q = q.view(t, self.num_heads, self.nope + self.rope_dim)
        q_nope, q_rope = q.split([self.nope, self.rope_dim], dim=-1)  # [T, H, nope], [T, H, rope]
        c_kv, k_rope = latent.split([self.kv_lora_rank, self.rope_dim], dim=-1)  # latent: [T, D]
        cos, sin = rope_cos_sin  # float32: rotations are computed in float32, rounded once
        q_rope = apply_rope(q_rope, cos[:, None], sin[:, None], self.interleave).to(q.dtype)
        k_rope = apply_rope(k_rope, cos, sin, self.interleave)  # rounded on the cache write
        c_kv = self.kv_a_layernorm(c_kv, k_rope.dtype)
        new_rows = torch.cat((c_kv, k_rope), dim=-1)  # [T, kv_lora + rope]
        kv_cache.index_copy_(0, meta.write_slots, new_rows.to(kv_cache.dtype))
        b, length = meta.kv_slots.shape
        context = kv_cache.index_select(0, meta.kv_slots.view(-1)).view(b, length, -1)  # [B, L, D]
        if absorbed:
            out = self._absorbed(q_nope, q_rope, context, meta)
        else:
            out = self._expanded(q_nope, q_rope, context, meta)
        return self.o_proj(out.reshape(t, self.num_heads * self.v_dim))

    def _pad(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """[T, ...] -> [B, Q, ...] in the padded query layout (identity for one sequence)."""
        b, q = meta.batch_size, meta.max_query_len
        if b == 1:
            return x.unsqueeze(0)
        padded = x.new_zeros((b * q,) + x.shape[1:])
        padded[meta.padded_pos] = x
        return padded.view((b, q) + x.shape[1:])

    def _unpad(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """[B, Q, ...] -> [T, ...]."""
        if meta.batch_size == 1:
            return x[0]
        return x.reshape((-1,) + x.shape[2:])[meta.padded_pos]

    def _kv_b_heads(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK [H, nope, kv_lora] and W_UV [H, v, kv_lora] views of kv_b_proj."""
        w = self.kv_b_proj.dense_weight(dtype).view(self.num_heads, self.nope + self.v_dim, -1)
        return w[:, : self.nope], w[:, self.nope :]

    def _absorbed(self, q_nope, q_rope, context, meta: AttentionMetadata) -> torch.Tensor:
        length = context.shape[1]
        w_uk, w_uv = self._kv_b_heads(q_nope.dtype)
        # q_lat[t, h] = W_UK_h^T q_nope[t, h]: [H, T, nope] @ [H, nope, kv_lora] -> [T, H, kv_lora]
        q_lat = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)
        q_full = self._pad(torch.cat((q_lat, q_rope), dim=-1), meta)  # [B, Q, H, kv_lora + rope]
        b, q_len, h, d = q_full.shape
        # All heads share the single latent key/value, so the Q*H (query, head) pairs attend as
        # one head of one fused SDPA call per sequence. The latent row is both key and value
        # (its last `rope` output columns are dropped); SDPA keeps scores and softmax in
        # float32, where separate bmms would round the scores to bf16 first.
        mask = None
        if meta.mask is not None:  # [B, Q, L] -> [B, 1, Q*H, L]
            mask = meta.mask[:, None, :, None].expand(-1, -1, -1, h, -1).reshape(b, 1, -1, length)
        kv = context[:, None]  # [B, 1, L, kv_lora + rope]
        out = F.scaled_dot_product_attention(
            q_full.view(b, 1, q_len * h, d), kv, kv, attn_mask=mask, scale=self.scale
        )  # [B, 1, Q*H, kv_lora + rope]
        out_lat = self._unpad(out.view(b, q_len, h, d)[..., : self.kv_lora_rank], meta)
        # out[t, h] = W_UV_h out_lat[t, h]: [H, T, kv_lora] @ [H, kv_lora, v] -> [T, H, v]
        return torch.bmm(out_lat.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)

    def _expanded(self, q_nope, q_rope, context, meta: AttentionMetadata) -> torch.Tensor:
        b, length, _ = context.shape
        c_kv, k_rope = context.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        kv = self.kv_b_proj(c_kv).view(b, length, self.num_heads, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)  # [B, L, H, nope], [B, L, H, v]
        k = torch.cat((k_nope, k_rope[:, :, None, :].expand(-1, -1, self.num_heads, -1)), dim=-1)
        q = self._pad(torch.cat((q_nope, q_rope), dim=-1), meta)  # [B, Q, H, nope + rope]
        # SDPA's fused kernels need v's head dim equal to q/k's: zero-pad v, slice the output.
        qk_dim = self.nope + self.rope_dim
        if self.v_dim < qk_dim:
            v = F.pad(v, (0, qk_dim - self.v_dim))
        # Every sequence a fresh prompt of the same length: plain causal, no mask needed.
        causal = meta.max_query_len == length and meta.sum_query_len == meta.batch_size * length
        mask = None if causal or meta.mask is None else meta.mask[:, None]  # [B, 1, Q, L]
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=mask,
            is_causal=causal,
            scale=self.scale,
        )  # [B, H, Q, qk_dim]
        return self._unpad(out.transpose(1, 2)[..., : self.v_dim], meta)  # [T, H, v]
