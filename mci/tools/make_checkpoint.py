"""Seeded random DeepSeek-V3-architecture checkpoints in the real Hugging Face on-disk format.

Two standard sizes: `tiny` (about 2M parameters, for tests) and `small` (about 108M in the main
model, for benchmarks). Weights are drawn in the layout's order from one seeded generator, so a
(size, seed) pair always gives the same checkpoint, whatever the export format:
bf16/fp16/fp32, or FP8 e4m3 with 128x128 `weight_scale_inv` blocks quantised from the bf16
values. The MTP layer is included unless asked otherwise.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

from mci.layers.linear import quantize_fp8_blocks
from mci.model_config import Fp8Config, ModelConfig, RopeConfig
from mci.models.layout import checkpoint_layout
from mci.tools.bpe import stdlib_corpus, train_bpe, write_tokenizer

PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(
        vocab_size=2048,
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        first_k_dense_replace=1,
        moe_layer_freq=1,
        kv_lora_rank=32,
        q_lora_rank=48,
        qk_rope_head_dim=16,
        qk_nope_head_dim=32,
        v_head_dim=32,
        max_position_embeddings=2048,
        num_nextn_predict_layers=1,
    ),
    "small": ModelConfig(
        vocab_size=8192,
        hidden_size=512,
        intermediate_size=1536,
        moe_intermediate_size=256,
        num_hidden_layers=8,
        num_attention_heads=8,
        n_routed_experts=32,
        n_shared_experts=1,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        first_k_dense_replace=1,
        moe_layer_freq=1,
        kv_lora_rank=128,
        q_lora_rank=256,
        qk_rope_head_dim=32,
        qk_nope_head_dim=64,
        v_head_dim=64,
        max_position_embeddings=4096,
        num_nextn_predict_layers=1,
    ),
}

YARN_EXAMPLE = RopeConfig(
    theta=10000.0,
    rope_type="yarn",
    factor=4.0,
    original_max_position_embeddings=512,
    beta_fast=32.0,
    beta_slow=1.0,
    mscale=0.707,
    mscale_all_dim=0.707,
)


def preset_config(size: str, **overrides) -> ModelConfig:
    """A standard size with field overrides (e.g. `q_lora_rank=None`, `rope=YARN_EXAMPLE`)."""
    return dataclasses.replace(PRESETS[size], **overrides)


def long_context(cfg: ModelConfig, context: int) -> ModelConfig:
    """`cfg` stretched to `context` positions the way DeepSeek-V3 stretches its 4,096: YaRN
    over the original context (factor context / original, beta 32 / 1, mscale 1 on every
    dimension)."""
    original = cfg.max_position_embeddings
    if context <= original:
        return dataclasses.replace(cfg, max_position_embeddings=context)
    rope = RopeConfig(
        theta=cfg.rope.theta,
        rope_type="yarn",
        factor=context / original,
        original_max_position_embeddings=original,
        beta_fast=32.0,
        beta_slow=1.0,
        mscale=1.0,
        mscale_all_dim=1.0,
    )
    return dataclasses.replace(cfg, max_position_embeddings=context, rope=rope)


def _random_tensor(name: str, shape: tuple[int, ...], gen: torch.Generator, bias_std: float):
    """Weights that keep activations O(1): fan-in scaled linears, unit embeddings, noisy norms."""
    if name.endswith("e_score_correction_bias"):
        return torch.randn(shape, generator=gen) * bias_std
    if len(shape) == 1:  # RMSNorm weights: near 1 so every norm matters in parity tests
        return 1.0 + 0.1 * torch.randn(shape, generator=gen)
    if "embed_tokens" in name:
        return torch.randn(shape, generator=gen)
    return torch.randn(shape, generator=gen) / math.sqrt(shape[1])


def random_weights(cfg: ModelConfig, seed: int, bias_std: float = 0.05) -> dict[str, torch.Tensor]:
    """Full-precision random weights for every tensor of the (unquantised) layout."""
    gen = torch.Generator().manual_seed(seed)
    plain = dataclasses.replace(cfg, fp8=None)
    return {
        s.name: _random_tensor(s.name, s.shape, gen, bias_std)
        for s in checkpoint_layout(plain, dtype="F32")
    }


def make_checkpoint(
    out_dir: str | Path,
    cfg: ModelConfig,
    seed: int = 0,
    dtype: str = "bfloat16",
    fp8: bool = False,
    include_mtp: bool = True,
    shard_max_bytes: int | None = None,
    config_dialect: str = "4",
    bias_std: float = 0.05,
    tokenizer_corpus_bytes: int = 2_000_000,
    markup: bool = False,
) -> Path:
    """Write a seeded random checkpoint with a tokenizer trained on the stdlib (with DeepSeek-V3's
    tool and think tokens and its tool-call template when `markup`)."""
    tok = train_bpe(cfg.vocab_size, stdlib_corpus(tokenizer_corpus_bytes), markup)
    weights = random_weights(cfg, seed, bias_std)
    return write_checkpoint(
        out_dir, cfg, weights, tok, dtype, fp8, include_mtp, shard_max_bytes, config_dialect
    )


def write_checkpoint(
    out_dir: str | Path,
    cfg: ModelConfig,
    weights: dict[str, torch.Tensor],
    tokenizer,
    dtype: str = "bfloat16",
    fp8: bool = False,
    include_mtp: bool = True,
    shard_max_bytes: int | None = None,
    config_dialect: str = "4",
) -> Path:
    """Write `weights` (full precision, named as in the unquantised layout) in the real
    on-disk format: config.json, safetensors (sharded when `shard_max_bytes` is set), tokenizer.
    With `fp8`, the projections are block-quantised from their bf16-rounded values."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    dtypes = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
    cfg = dataclasses.replace(cfg, torch_dtype=dtype, fp8=Fp8Config() if fp8 else None)
    tensors: dict[str, torch.Tensor] = {}
    for spec in checkpoint_layout(cfg, include_mtp=include_mtp):
        if spec.name.endswith(".weight_scale_inv"):
            continue  # written with its weight
        w = weights[spec.name]
        if spec.dtype == "F8_E4M3":
            q, scale_inv = quantize_fp8_blocks(w.to(torch.bfloat16).float(), cfg.fp8.block_size)
            tensors[spec.name] = q
            tensors[spec.name.replace(".weight", ".weight_scale_inv")] = scale_inv
        elif spec.dtype == "F32":
            tensors[spec.name] = w.float().contiguous()
        else:
            tensors[spec.name] = w.to(dtypes[dtype]).contiguous()
    _save_shards(out, tensors, shard_max_bytes)
    (out / "config.json").write_text(json.dumps(cfg.to_hf_dict(config_dialect), indent=2))
    gen_cfg = {"bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_ids[0]}
    (out / "generation_config.json").write_text(json.dumps(gen_cfg, indent=2))
    write_tokenizer(out, tokenizer, cfg.max_position_embeddings)
    return out


def _save_shards(out: Path, tensors: dict[str, torch.Tensor], shard_max_bytes: int | None) -> None:
    if shard_max_bytes is None:
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        return
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > shard_max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / file), metadata={"format": "pt"})
        weight_map.update({name: file for name in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
