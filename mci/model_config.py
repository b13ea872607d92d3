"""Frozen model configuration, parsed once from a Hugging Face `config.json`.

Both config dialects in the wild are accepted:

* transformers 4.x (the published DeepSeek-V3 checkpoint): `rope_theta` plus `rope_scaling`
  (`{"type": "yarn", ...}`), and explicit `topk_method`, `scoring_func`, `moe_layer_freq`.
* transformers 5.x: `rope_parameters` (`{"rope_type": ..., "rope_theta": ...}`) and no
  `topk_method` / `scoring_func` / `moe_layer_freq`; absent means DeepSeek-V3's values
  (`noaux_tc`, `sigmoid`, 1).

After parsing, nothing reads the raw dict again: every component gets this frozen object.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from mci.errors import ConfigError

SUPPORTED_ARCHITECTURES = ("DeepseekV3ForCausalLM",)
SUPPORTED_MODEL_TYPES = ("deepseek_v3",)


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters: plain RoPE (`rope_type="default"`) or YaRN."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    # YaRN's cos/sin multiplier; None means "derive from factor/mscale" as transformers does.
    attention_factor: float | None = None
    truncate: bool = True


@dataclass(frozen=True)
class Fp8Config:
    """FP8 block quantisation of the checkpoint (`quantization_config.quant_method == "fp8"`)."""

    block_size: tuple[int, int] = (128, 128)
    fmt: str = "e4m3"


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a DeepSeek-V3-class model; field names follow `config.json`."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    first_k_dense_replace: int
    moe_layer_freq: int
    kv_lora_rank: int
    q_lora_rank: int | None
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = field(default_factory=RopeConfig)
    rope_interleave: bool = True
    tie_word_embeddings: bool = False
    num_nextn_predict_layers: int = 0
    bos_token_id: int | None = 0
    eos_token_ids: tuple[int, ...] = (1,)
    torch_dtype: str = "bfloat16"
    fp8: Fp8Config | None = None

    # ---- derived numbers -------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_latent_dim(self) -> int:
        """Values cached per token per layer: the compressed latent plus the shared rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def num_mtp_layers(self) -> int:
        return self.num_nextn_predict_layers

    def is_moe_layer(self, layer_idx: int) -> bool:
        """DeepSeek's rule: MoE from `first_k_dense_replace` on, every `moe_layer_freq`-th layer."""
        return (
            self.n_routed_experts > 0
            and layer_idx >= self.first_k_dense_replace
            and layer_idx % self.moe_layer_freq == 0
        )

    @property
    def num_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.num_hidden_layers))

    def kv_bytes_per_token(self, dtype_bytes: int = 2, include_mtp: bool = False) -> int:
        """Bytes of MLA latent cache per token over all layers (70,272 for V3 in bf16)."""
        layers = self.num_hidden_layers + (self.num_mtp_layers if include_mtp else 0)
        return self.kv_latent_dim * layers * dtype_bytes

    @property
    def softmax_scale(self) -> float:
        """1/sqrt(qk_head_dim), times mscale(factor, mscale_all_dim)^2 under YaRN."""
        scale = self.qk_head_dim**-0.5
        if self.rope.rope_type != "default" and self.rope.mscale_all_dim:
            m = yarn_mscale(self.rope.factor, self.rope.mscale_all_dim)
            scale *= m * m
        return scale

    def to_hf_dict(self, dialect: str = "4") -> dict[str, Any]:
        """Serialise as a Hugging Face `config.json` in transformers' 4.x or 5.x dialect."""
        d: dict[str, Any] = {
            "architectures": ["DeepseekV3ForCausalLM"],
            "model_type": "deepseek_v3",
            "attention_bias": False,
            "attention_dropout": 0.0,
            "hidden_act": "silu",
            "initializer_range": 0.02,
            "use_cache": True,
            "num_key_value_heads": self.num_attention_heads,
        }
        for name in (
            "vocab_size hidden_size intermediate_size moe_intermediate_size num_hidden_layers "
            "num_attention_heads n_routed_experts n_shared_experts num_experts_per_tok n_group "
            "topk_group routed_scaling_factor norm_topk_prob first_k_dense_replace kv_lora_rank "
            "q_lora_rank qk_rope_head_dim qk_nope_head_dim v_head_dim max_position_embeddings "
            "rms_norm_eps rope_interleave tie_word_embeddings num_nextn_predict_layers "
            "bos_token_id torch_dtype"
        ).split():
            d[name] = getattr(self, name)
        d["eos_token_id"] = (
            self.eos_token_ids[0] if len(self.eos_token_ids) == 1 else list(self.eos_token_ids)
        )
        rope = {k: v for k, v in asdict(self.rope).items() if v is not None}
        rope.pop("truncate")
        theta = rope.pop("theta")
        rope_type = rope.pop("rope_type")
        if rope_type == "default":
            rope = {}
        if dialect == "4":
            d.update(
                topk_method="noaux_tc", scoring_func="sigmoid", moe_layer_freq=self.moe_layer_freq
            )
            d["rope_theta"] = theta
            d["rope_scaling"] = {"type": rope_type, **rope} if rope else None
        elif dialect == "5":
            if self.moe_layer_freq != 1:
                d["moe_layer_freq"] = self.moe_layer_freq
            d["rope_parameters"] = {"rope_type": rope_type, "rope_theta": theta, **rope}
        else:
            raise ValueError(f"unknown config dialect {dialect!r}")
        if self.fp8 is not None:
            d["quantization_config"] = {
                "activation_scheme": "dynamic",
                "fmt": self.fp8.fmt,
                "quant_method": "fp8",
                "weight_block_size": list(self.fp8.block_size),
            }
        return d


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature correction: 0.1 * mscale * ln(factor) + 1 for factor > 1."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _require(raw: dict[str, Any], key: str) -> Any:
    if key not in raw:
        raise ConfigError(f"config.json is missing required field {key!r}")
    return raw[key]


def _parse_rope(raw: dict[str, Any]) -> RopeConfig:
    """Normalise 4.x `rope_theta`+`rope_scaling` and 5.x `rope_parameters` into one RopeConfig."""
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ConfigError("config.json: rope_parameters/rope_scaling must be an object")
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", "yarn"):
        raise ConfigError(f"unsupported rope type {rope_type!r} (supported: default, yarn)")
    if rope_type == "default":
        return RopeConfig(theta=float(theta))
    factor = params.get("factor")
    original = params.get("original_max_position_embeddings", raw.get("max_position_embeddings"))
    if factor is None:
        factor = raw["max_position_embeddings"] / original
    return RopeConfig(
        theta=float(theta),
        rope_type="yarn",
        factor=float(factor),
        original_max_position_embeddings=int(original),
        beta_fast=float(params.get("beta_fast") or 32),
        beta_slow=float(params.get("beta_slow") or 1),
        mscale=params.get("mscale"),
        mscale_all_dim=params.get("mscale_all_dim"),
        attention_factor=params.get("attention_factor"),
        truncate=bool(params.get("truncate", True)),
    )


def parse_config(raw: dict[str, Any]) -> ModelConfig:
    """Validate a raw `config.json` dict and turn it into a frozen ModelConfig."""
    archs = raw.get("architectures") or []
    model_type = raw.get("model_type")
    if not any(a in SUPPORTED_ARCHITECTURES for a in archs) and model_type not in (
        SUPPORTED_MODEL_TYPES
    ):
        got = ", ".join(archs) or model_type or "nothing"
        raise ConfigError(
            f"unsupported architecture {got!r}; mci serves {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    topk_method = raw.get("topk_method") or "noaux_tc"
    scoring = raw.get("scoring_func") or "sigmoid"
    if topk_method != "noaux_tc" or scoring != "sigmoid":
        raise ConfigError(
            f"unsupported routing topk_method={topk_method!r} scoring_func={scoring!r} "
            "(DeepSeek-V3 uses noaux_tc with sigmoid)"
        )
    if raw.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"unsupported hidden_act {raw['hidden_act']!r} (expected silu)")
    if raw.get("attention_bias"):
        raise ConfigError("unsupported attention_bias=true (DeepSeek-V3 has no attention bias)")
    heads = _require(raw, "num_attention_heads")
    if raw.get("num_key_value_heads", heads) != heads:
        raise ConfigError("MLA requires num_key_value_heads == num_attention_heads")
    eos = raw.get("eos_token_id", 1)
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    quant = raw.get("quantization_config")
    fp8 = None
    if quant:
        if quant.get("quant_method") != "fp8" or quant.get("fmt", "e4m3") != "e4m3":
            raise ConfigError(f"unsupported quantization_config {quant} (supported: fp8 e4m3)")
        block = tuple(quant.get("weight_block_size") or (128, 128))
        fp8 = Fp8Config(block_size=(int(block[0]), int(block[1])))
    n_routed = int(raw.get("n_routed_experts") or 0)
    try:
        cfg = ModelConfig(
            vocab_size=int(_require(raw, "vocab_size")),
            hidden_size=int(_require(raw, "hidden_size")),
            intermediate_size=int(_require(raw, "intermediate_size")),
            moe_intermediate_size=int(raw.get("moe_intermediate_size") or 0),
            num_hidden_layers=int(_require(raw, "num_hidden_layers")),
            num_attention_heads=int(heads),
            n_routed_experts=n_routed,
            n_shared_experts=int(raw.get("n_shared_experts") or 0),
            num_experts_per_tok=int(raw.get("num_experts_per_tok") or 0),
            n_group=int(raw.get("n_group") or 1),
            topk_group=int(raw.get("topk_group") or 1),
            routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
            norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
            first_k_dense_replace=int(raw.get("first_k_dense_replace") or 0),
            moe_layer_freq=int(raw.get("moe_layer_freq") or 1),
            kv_lora_rank=int(_require(raw, "kv_lora_rank")),
            q_lora_rank=None if raw.get("q_lora_rank") is None else int(raw["q_lora_rank"]),
            qk_rope_head_dim=int(_require(raw, "qk_rope_head_dim")),
            qk_nope_head_dim=int(_require(raw, "qk_nope_head_dim")),
            v_head_dim=int(_require(raw, "v_head_dim")),
            max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope=_parse_rope(raw),
            rope_interleave=bool(raw.get("rope_interleave", True)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            num_nextn_predict_layers=int(raw.get("num_nextn_predict_layers") or 0),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
            torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "bfloat16"),
            fp8=fp8,
        )
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"config.json has a malformed field: {exc}") from None
    if n_routed:
        if n_routed % cfg.n_group or cfg.topk_group > cfg.n_group:
            raise ConfigError(
                "n_routed_experts must divide into n_group groups, topk_group <= n_group"
            )
        if cfg.num_experts_per_tok > (n_routed // cfg.n_group) * cfg.topk_group:
            raise ConfigError("num_experts_per_tok exceeds the experts in the selected groups")
    return cfg


def load_config(path: str | Path) -> ModelConfig:
    """Read `config.json` from a checkpoint directory (or the file itself)."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.exists():
        raise ConfigError(f"no config.json at {file}")
    try:
        raw = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{file} is not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{file} must hold a JSON object")
    return parse_config(raw)
