"""The on-disk tensor layout of a DeepSeek-V3 checkpoint, derived from its config alone.

One source of truth for three users: the loader (what must be present, with which shape),
the checkpoint maker (what to write) and `mci plan` (how many bytes, without any weights).

Names follow the published checkpoint (see shared/reference/deepseek-v3/tensors.tsv):

    model.embed_tokens.weight                         [vocab, hidden]
    model.layers.{i}.self_attn.*                      MLA projections and norms
    model.layers.{i}.mlp.{gate,up,down}_proj.weight   dense layers (< first_k_dense_replace)
    model.layers.{i}.mlp.gate.weight / .e_score_correction_bias   the MoE router
    model.layers.{i}.mlp.experts.{e}.*_proj.weight    routed experts
    model.layers.{i}.mlp.shared_experts.*_proj.weight shared experts
    model.layers.{N}.{enorm,hnorm,eh_proj,embed_tokens,shared_head.*} + a full block: MTP
    model.norm.weight, lm_head.weight

FP8 checkpoints quantise exactly the projections inside `self_attn` and `mlp` (experts and
shared experts included; not the router gate, embeddings, heads or `eh_proj`), each with a
float32 `weight_scale_inv` of ceil(rows/128) x ceil(cols/128).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mci.model_config import ModelConfig

# safetensors dtype names and their sizes in bytes.
DTYPE_BYTES = {"F8_E4M3": 1, "BF16": 2, "F16": 2, "F32": 4}


@dataclass(frozen=True)
class TensorSpec:
    """One tensor as stored on disk."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # a safetensors dtype name: F8_E4M3, BF16, F16, F32

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_BYTES[self.dtype]


def torch_dtype_to_st(name: str) -> str:
    """Map a config `torch_dtype` string to the safetensors dtype name."""
    return {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}.get(name, "BF16")


def attention_linears(cfg: ModelConfig) -> list[tuple[str, tuple[int, int]]]:
    """(suffix, [out, in]) of the MLA projections of one layer."""
    h = cfg.num_attention_heads
    out = []
    if cfg.q_lora_rank is None:
        out.append(("q_proj", (h * cfg.qk_head_dim, cfg.hidden_size)))
    else:
        out.append(("q_a_proj", (cfg.q_lora_rank, cfg.hidden_size)))
        out.append(("q_b_proj", (h * cfg.qk_head_dim, cfg.q_lora_rank)))
    out.append(("kv_a_proj_with_mqa", (cfg.kv_latent_dim, cfg.hidden_size)))
    out.append(("kv_b_proj", (h * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank)))
    out.append(("o_proj", (cfg.hidden_size, h * cfg.v_head_dim)))
    return out


def mlp_linears(hidden: int, inter: int) -> list[tuple[str, tuple[int, int]]]:
    """(suffix, [out, in]) of a SiLU-gated MLP."""
    return [
        ("gate_proj", (inter, hidden)),
        ("up_proj", (inter, hidden)),
        ("down_proj", (hidden, inter)),
    ]


class _Builder:
    def __init__(self, cfg: ModelConfig, dtype: str):
        self.cfg, self.dtype = cfg, dtype
        self.fp8 = cfg.fp8 is not None
        self.specs: list[TensorSpec] = []

    def plain(self, name: str, shape: tuple[int, ...], dtype: str | None = None) -> None:
        self.specs.append(TensorSpec(name, shape, dtype or self.dtype))

    def linear(self, name: str, shape: tuple[int, int], quantizable: bool) -> None:
        if quantizable and self.fp8:
            bo, bi = self.cfg.fp8.block_size
            self.plain(f"{name}.weight", shape, "F8_E4M3")
            scale = (math.ceil(shape[0] / bo), math.ceil(shape[1] / bi))
            self.plain(f"{name}.weight_scale_inv", scale, "F32")
        else:
            self.plain(f"{name}.weight", shape)

    def decoder_block(self, p: str, moe: bool) -> None:
        cfg = self.cfg
        self.plain(f"{p}.input_layernorm.weight", (cfg.hidden_size,))
        self.plain(f"{p}.post_attention_layernorm.weight", (cfg.hidden_size,))
        for suffix, shape in attention_linears(cfg):
            self.linear(f"{p}.self_attn.{suffix}", shape, quantizable=True)
        if cfg.q_lora_rank is not None:
            self.plain(f"{p}.self_attn.q_a_layernorm.weight", (cfg.q_lora_rank,))
        self.plain(f"{p}.self_attn.kv_a_layernorm.weight", (cfg.kv_lora_rank,))
        if not moe:
            for suffix, shape in mlp_linears(cfg.hidden_size, cfg.intermediate_size):
                self.linear(f"{p}.mlp.{suffix}", shape, quantizable=True)
            return
        self.plain(f"{p}.mlp.gate.weight", (cfg.n_routed_experts, cfg.hidden_size))
        self.plain(f"{p}.mlp.gate.e_score_correction_bias", (cfg.n_routed_experts,), "F32")
        for e in range(cfg.n_routed_experts):
            for suffix, shape in mlp_linears(cfg.hidden_size, cfg.moe_intermediate_size):
                self.linear(f"{p}.mlp.experts.{e}.{suffix}", shape, quantizable=True)
        if cfg.n_shared_experts:
            inter = cfg.moe_intermediate_size * cfg.n_shared_experts
            for suffix, shape in mlp_linears(cfg.hidden_size, inter):
                self.linear(f"{p}.mlp.shared_experts.{suffix}", shape, quantizable=True)


def checkpoint_layout(
    cfg: ModelConfig, dtype: str | None = None, include_mtp: bool = True
) -> list[TensorSpec]:
    """Every tensor a complete checkpoint of `cfg` holds, in a stable order.

    `dtype` is the safetensors dtype of unquantised tensors (default: the config's torch_dtype).
    """
    b = _Builder(cfg, dtype or torch_dtype_to_st(cfg.torch_dtype))
    vocab, hidden = cfg.vocab_size, cfg.hidden_size
    b.plain("model.embed_tokens.weight", (vocab, hidden))
    for i in range(cfg.num_hidden_layers):
        b.decoder_block(f"model.layers.{i}", cfg.is_moe_layer(i))
    b.plain("model.norm.weight", (hidden,))
    if not cfg.tie_word_embeddings:
        b.plain("lm_head.weight", (vocab, hidden))
    if include_mtp:
        for p in mtp_prefixes(cfg):
            b.plain(f"{p}.embed_tokens.weight", (vocab, hidden))
            b.plain(f"{p}.enorm.weight", (hidden,))
            b.plain(f"{p}.hnorm.weight", (hidden,))
            b.plain(f"{p}.eh_proj.weight", (hidden, 2 * hidden))
            b.decoder_block(p, moe=cfg.n_routed_experts > 0)
            b.plain(f"{p}.shared_head.norm.weight", (hidden,))
            b.plain(f"{p}.shared_head.head.weight", (vocab, hidden))
    return b.specs


def mtp_prefixes(cfg: ModelConfig) -> list[str]:
    """Name prefixes of the MTP modules: they follow the main layers' numbering."""
    n = cfg.num_hidden_layers
    return [f"model.layers.{n + k}" for k in range(cfg.num_mtp_layers)]
