"""`mci plan`: does a model fit on given GPUs, and how much KV cache is left?

Everything is computed from `config.json` alone through the checkpoint layout, so the weight
bytes are exact (FP8 blocks and their float32 scales included). Two layouts are shown:

* tp: pure tensor parallelism over all N GPUs. Head-, column- and row-parallel projections,
  vocabulary-parallel embeddings and heads, experts split N ways; small tensors (norms, router,
  `q_a_proj`, `kv_a_proj_with_mqa`, `eh_proj`) replicated. MLA has a single latent "KV head",
  so every rank caches the full latent of every token: KV capacity is one rank's room.
* dp-attention + ep: attention, dense layers, shared experts and embeddings replicated on each
  GPU (data-parallel attention), routed experts split by expert (expert parallelism). Each rank
  caches only its own requests' latents: KV capacity is the sum over ranks.

GPU sizes use the vendors' decimal GB (H100 = 80e9 bytes, H200 = 141e9 bytes).
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass

from mci.errors import UserError
from mci.model_config import ModelConfig
from mci.models.layout import TensorSpec, checkpoint_layout

GPU_BYTES = {"H100": 80 * 10**9, "H200": 141 * 10**9, "B200": 180 * 10**9, "A100": 80 * 10**9}

_REPLICATED_UNDER_TP = (
    "layernorm",
    "norm.weight",
    "mlp.gate.",
    "q_a_proj",
    "kv_a_proj_with_mqa",
    "eh_proj",
)
_REPLICATED_UNDER_DP = (
    "self_attn.",
    "embed_tokens",
    "lm_head",
    "shared_head",
    "eh_proj",
    "norm",
    "shared_experts.",
    "mlp.gate.",
)


@dataclass(frozen=True)
class Hardware:
    """`count` GPUs of `bytes_per_gpu` each; `name` as the user wrote it."""

    name: str
    count: int
    bytes_per_gpu: int


def parse_gpus(spec: str) -> Hardware:
    """'8xH200', '16xH100', '8x141GB', '4x80GiB' or '4x80' (GiB)."""
    m = re.fullmatch(
        r"\s*(\d+)\s*[x×*]\s*([A-Za-z]\d+|[\d.]+)\s*(GiB|GB|G)?\s*", spec, re.IGNORECASE
    )
    if not m:
        raise UserError(f"bad --gpus {spec!r}: use e.g. 8xH200, 16xH100 or 8x141GB")
    count, what, unit = int(m.group(1)), m.group(2), (m.group(3) or "GiB").lower()
    if count < 1:
        raise UserError("--gpus needs at least one GPU")
    if what[0].isalpha():
        if what.upper() not in GPU_BYTES:
            raise UserError(f"unknown GPU {what!r} (known: {', '.join(GPU_BYTES)}; or give a size)")
        return Hardware(spec, count, GPU_BYTES[what.upper()])
    size = float(what) * (10**9 if unit == "gb" else 2**30)
    return Hardware(spec, count, int(size))


@dataclass(frozen=True)
class LayoutPlan:
    """Memory of one parallel layout."""

    name: str
    weight_bytes_per_gpu: int
    kv_room_bytes_per_gpu: int  # negative: the weights alone do not fit the budget
    kv_tokens_per_gpu: int
    kv_tokens_total: int  # over the whole deployment

    @property
    def fits(self) -> bool:
        return self.kv_tokens_per_gpu > 0


@dataclass(frozen=True)
class Plan:
    """The full answer of `mci plan`."""

    weight_bytes_by_dtype: dict[str, int]
    num_tensors: int
    kv_bytes_per_token: int
    kv_bytes_per_token_mtp: int
    budget_bytes_per_gpu: int
    layouts: tuple[LayoutPlan, ...]

    @property
    def weight_bytes(self) -> int:
        return sum(self.weight_bytes_by_dtype.values())


def _allocated_bytes(spec: TensorSpec) -> int:
    """Bytes the engine allocates for a tensor: its on-disk size, except the MoE router's
    weight, which it keeps in float32 (mci/layers/moe.py: routing is a discrete choice)."""
    if spec.name.endswith(".mlp.gate.weight"):
        return spec.numel * 4
    return spec.nbytes


def _tp_bytes(spec: TensorSpec, n: int) -> float:
    if any(key in spec.name for key in _REPLICATED_UNDER_TP) or len(spec.shape) == 1:
        return _allocated_bytes(spec)
    return _allocated_bytes(spec) / n


def _dp_ep_bytes(spec: TensorSpec, n: int) -> float:
    if ".mlp.experts." in spec.name:
        return _allocated_bytes(spec) / n
    return _allocated_bytes(spec)  # replicated on every data-parallel attention rank


def make_plan(
    cfg: ModelConfig,
    hw: Hardware,
    mem_fraction: float = 0.9,
    kv_dtype_bytes: int = 2,
    include_mtp: bool = True,
) -> Plan:
    """Weights, KV bytes and KV capacity of `cfg` on `hw` at `mem_fraction` of each GPU."""
    if not 0 < mem_fraction <= 1:
        raise UserError("--mem-fraction-static must be in (0, 1]")
    specs = checkpoint_layout(cfg, include_mtp=include_mtp)
    by_dtype: dict[str, int] = defaultdict(int)
    for s in specs:
        by_dtype[s.dtype] += s.nbytes
    kv = cfg.kv_bytes_per_token(kv_dtype_bytes)
    budget = int(hw.bytes_per_gpu * mem_fraction)
    layouts = []
    for name, per_tensor, kv_sharded in (
        (f"tp{hw.count}", _tp_bytes, False),
        (f"dp-attention{hw.count}+ep{hw.count}", _dp_ep_bytes, True),
    ):
        per_gpu = int(sum(per_tensor(s, hw.count) for s in specs))
        room = budget - per_gpu
        tokens = max(room, 0) // kv
        total = tokens * hw.count if kv_sharded else tokens
        layouts.append(LayoutPlan(name, per_gpu, room, tokens, total))
    return Plan(
        weight_bytes_by_dtype=dict(by_dtype),
        num_tensors=len(specs),
        kv_bytes_per_token=kv,
        kv_bytes_per_token_mtp=cfg.kv_bytes_per_token(kv_dtype_bytes, include_mtp=True),
        budget_bytes_per_gpu=budget,
        layouts=tuple(layouts),
    )


def format_plan(plan: Plan, hw: Hardware, mem_fraction: float) -> str:
    """The human-readable report printed by `mci plan`."""
    gb = 1e9
    lines = [
        f"weights: {plan.weight_bytes:,} bytes ({plan.weight_bytes / gb:.2f} GB) in "
        f"{plan.num_tensors:,} tensors"
    ]
    for dtype, nbytes in sorted(plan.weight_bytes_by_dtype.items(), key=lambda kv: -kv[1]):
        lines.append(f"  {dtype:8s} {nbytes:>20,} bytes")
    lines.append(
        f"KV cache (MLA latent): {plan.kv_bytes_per_token:,} bytes/token "
        f"({plan.kv_bytes_per_token_mtp:,} with the MTP layer for speculative decoding)"
    )
    lines.append(
        f"hardware: {hw.count} x {hw.bytes_per_gpu / gb:.1f} GB; budget at "
        f"mem fraction {mem_fraction}: {plan.budget_bytes_per_gpu / gb:.2f} GB per GPU"
    )
    lines.append(
        f"{'layout':28s} {'weights/GPU':>14s} {'KV room/GPU':>14s} {'KV tokens/GPU':>14s} "
        f"{'KV tokens total':>16s}"
    )
    for lp in plan.layouts:
        lines.append(
            f"{lp.name:28s} {lp.weight_bytes_per_gpu / gb:>11.2f} GB "
            f"{lp.kv_room_bytes_per_gpu / gb:>11.2f} GB {lp.kv_tokens_per_gpu:>14,} "
            f"{lp.kv_tokens_total:>16,}"
        )
    best = max(plan.layouts, key=lambda lp: lp.kv_tokens_total)
    if best.fits:
        lines.append(
            f"verdict: FITS — best layout {best.name} with {best.kv_tokens_total:,} KV tokens"
        )
    else:
        short = -max(lp.kv_room_bytes_per_gpu for lp in plan.layouts)
        lines.append(
            f"verdict: DOES NOT FIT — weights exceed the per-GPU budget by {short / gb:.2f} GB; "
            "use more or larger GPUs"
        )
    return "\n".join(lines)
