"""One DeepSeek-V3 decoder block: MLA attention, then a dense MLP or DeepSeekMoE."""

from __future__ import annotations

import torch
from torch import nn

from mci.kernels import cpu_decoder
from mci.kernels.cpu_kernels import kernel_weight
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
            normed = self.post_attention_layernorm(x, self.ffn_input_dtype)
        else:
            attn = self.self_attn(self.input_layernorm(x), meta, rope_cos_sin, kv_cache, absorbed)
            x, normed = self.post_attention_layernorm.add_then_norm(x, attn, self.ffn_input_dtype)
        ffn = self.mlp(normed)
        return x + (self.parallel.all_reduce(ffn) if self.dense_partial else ffn)

    def decode_on_kernels(self, rows: int) -> cpu_decoder.KernelLayer | None:
        """This layer as cpu_decoder.c runs it in a decode step of `rows` rows: the same
        kernel calls `forward` makes on that step (the attention sublayer, the norm, the
        one-call MoE or gated MLP), so the same values, several layers a call. None where
        some part would not run on the kernels at that size. The caller checks the step:
        float32 rows, a bf16 cache, an attention `decode_group`."""
        attention = self.self_attn.bound_decode(rows, self.input_layernorm)
        norm = self.post_attention_layernorm
        if attention is None or norm.kernels is None or self.dense_partial:
            return None
        ffn_norm = (norm.weight, norm.eps)
        mlp = self.mlp
        if isinstance(mlp, MoE):
            one_call = mlp.bound_call(rows)
            if one_call is None or not one_call[1]:  # the shared experts outside the call
                return None
            kernels = mlp.experts.gate_up_proj.skinny(1)
            if not kernels.gemm and rows > kernels.expert_max_rows:
                return None  # an expert could get more rows than the kernels' MoE takes
            gate = mlp.gate  # a plain F.linear on its float32 weight (bound_call refuses a
            # batch-invariant gate) can run in C
            plain = gate.weight.dtype == torch.float32
            router_weight = gate.weight.detach().contiguous() if plain else None
            return cpu_decoder.moe_layer(
                attention, ffn_norm, one_call[0], gate.logits, router_weight
            )
        parts = (mlp.gate_up_proj, mlp.down_proj)
        if self.ffn_input_dtype != torch.bfloat16 or any(p.skinny(rows) is None for p in parts):
            return None
        gate_up, down = (kernel_weight(p.kernel) for p in parts)
        return cpu_decoder.dense_layer(attention, ffn_norm, gate_up, down)
