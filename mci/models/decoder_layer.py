"""One DeepSeek-V3 decoder block: MLA attention, then a dense MLP or DeepSeekMoE."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from mci.layers.attention import MultiHeadLatentAttention
from mci.layers.mlp import GatedMLP
from mci.layers.moe import MoE
from mci.layers.norm import RMSNorm
from mci.model_config import ModelConfig
from mci.parallel.context import ParallelContext


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then h + ffn(norm(h)); the ffn is dense or MoE.

    The residual stream x is float32 whatever the compute dtype: each sublayer's output is
    added without rounding the running sum (transformers rounds it to bf16 twice per layer).
    Only [T, hidden] elementwise work is float32; every matmul input is in the compute dtype.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        moe: bool,
        dtype: torch.dtype,
        parallel: ParallelContext | None = None,
    ):
        super().__init__()
        self.parallel = parallel = parallel or ParallelContext.single()
        fp8 = cfg.fp8.block_size if cfg.fp8 else None
        # The MoE takes its input unrounded, for its router (see `MoE`).
        self.ffn_input_dtype = torch.float32 if moe else dtype
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = MultiHeadLatentAttention(cfg, dtype, fp8, parallel)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.dense_partial = not moe and parallel.tp_size > 1  # its output is all-reduced
        self.mlp = (
            MoE(cfg, dtype, fp8, parallel)
            if moe
            else GatedMLP(cfg.hidden_size, cfg.intermediate_size, dtype, fp8, parallel.tp_size)
        )

    def forward(self, x, meta, rope_cos_sin, kv_cache, absorbed: tuple[bool, ...]) -> torch.Tensor:
        """x: float32 [T, hidden] -> float32 [T, hidden]; kv_cache: [num_slots, latent_dim]
        of this layer."""
        attn = self.self_attn.decode_in_one_call(
            x, self.input_layernorm, meta, rope_cos_sin, kv_cache, absorbed
        )
        if attn is not None:  # a decode step on the CPU kernels: the same sum in one call
            x = attn
        else:
            x = x + self.self_attn(self.input_layernorm(x), meta, rope_cos_sin, kv_cache, absorbed)
        ffn = self.mlp(self.post_attention_layernorm(x, self.ffn_input_dtype))
        return x + (self.parallel.all_reduce(ffn) if self.dense_partial else ffn)

    def decode_on_kernels(self, rows: int) -> Callable[..., torch.Tensor] | None:
        """`forward` for a decode step of `rows` rows that runs wholly on the CPU kernels, as
        a function of (x, cos, sin, kv_cache, write_slots, kv_slots, lengths) with the
        layer's kernel calls bound once: the same calls `forward` makes on that step (the
        attention sublayer, the norm, the one-call MoE or gated MLP), so the same values,
        without the per-call checks and module dispatch (`small`, a 2-core EPYC: a one-row
        step 6.36 -> 5.69 ms median, alternating in one process).
        None where some part would not run on the kernels at that size. The caller checks
        the step: float32 rows, a bf16 cache, an attention `decode_group`."""
        attention = self.self_attn.bound_decode(rows, self.input_layernorm)
        norm = self.post_attention_layernorm
        if attention is None or norm.kernels is None or self.dense_partial:
            return None
        mlp, ffn_dtype = self.mlp, self.ffn_input_dtype
        if isinstance(mlp, MoE):
            one_call = mlp.bound_call(rows)
            if one_call is None or not one_call[1]:  # the shared experts outside the call
                return None
            moe, gate = one_call[0], mlp.gate

            def ffn(h: torch.Tensor) -> torch.Tensor:
                out = moe(h, gate.logits(h))[0]
                return out if out is not None else mlp(h)  # an expert over the kernels' rows

        elif all(p.skinny(rows) is not None for p in (mlp.gate_up_proj, mlp.down_proj)):
            ffn = mlp.forward  # GatedMLP's own kernel call
        else:
            return None
        rms_norm, norm_weight, eps = norm.kernels.rms_norm, norm.weight, norm.eps

        def step(x, cos, sin, kv_cache, write_slots, kv_slots, lengths) -> torch.Tensor:
            h = attention(x, cos, sin, kv_cache, write_slots, kv_slots, lengths)
            return h + ffn(rms_norm(h, norm_weight, eps, ffn_dtype))

        return step
