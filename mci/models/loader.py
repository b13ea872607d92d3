"""Load a Hugging Face DeepSeek-V3 checkpoint directory into `DeepseekV3ForCausalLM`.

Only safetensors are read (never pickle), through `safe_open`, which memory-maps each file:
tensors are copied one at a time into preallocated parameters, so peak memory is the model
plus one tensor. Before any data is read, every tensor's name, shape and dtype is checked
against the layout the config implies (`mci.models.layout`); any disagreement is a
`CheckpointError` naming the tensor.

FP8 tensors stay FP8; unquantised tensors are converted to the compute dtype.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from mci.errors import CheckpointError, UserError
from mci.model_config import ModelConfig, load_config
from mci.models.deepseek_v3 import DeepseekV3ForCausalLM
from mci.models.layout import checkpoint_layout, mtp_prefixes
from mci.parallel.context import ParallelContext
from mci.parallel.sharding import SKIP, local_expert, tensor_shard
from mci.process_tuning import huge_pages

log = logging.getLogger("mci")

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(\w+_proj\.\w+)$")
# Checkpoint projections that share an input and run fused: name -> (fused module, part).
_FUSED_PARTS = {
    "q_a_proj": ("fused_qkv_a_proj", 0),
    "q_proj": ("fused_qkv_a_proj", 0),
    "kv_a_proj_with_mqa": ("fused_qkv_a_proj", 1),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.*)$")


def resolve_dtype(name: str, cfg: ModelConfig) -> torch.dtype:
    """`auto` means the checkpoint's own dtype (bf16 for FP8 checkpoints: they compute in bf16)."""
    key = cfg.torch_dtype if name == "auto" else name
    if key not in DTYPES:
        raise UserError(f"unsupported dtype {name!r} (choose auto, bfloat16, float16 or float32)")
    return DTYPES[key]


def find_weight_files(path: Path) -> dict[str, Path]:
    """Map each tensor name to its safetensors file (sharded via the index, or single-file)."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index} is malformed: {exc}") from None
        files = {name: path / file for name, file in weight_map.items()}
        for file in set(files.values()):
            if not file.exists():
                raise CheckpointError(f"{index.name} names {file.name}, which does not exist")
        return files
    shards = sorted(path.glob("*.safetensors"))
    if not shards:
        if any(path.glob("*.bin")) or any(path.glob("*.pt")):
            raise CheckpointError(f"{path} holds only pickle weights; mci loads safetensors only")
        raise CheckpointError(f"no *.safetensors files in {path}")
    return {name: file for file in shards for name in _read_header(file)}


def _read_header(file: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape, safetensors dtype) without reading tensor data."""
    try:
        with safe_open(file, framework="pt") as f:
            out = {}
            for name in f.keys():
                sl = f.get_slice(name)
                out[name] = (tuple(sl.get_shape()), sl.get_dtype())
            return out
    except Exception as exc:  # safetensors raises several types for a damaged file
        raise CheckpointError(f"corrupted safetensors file {file.name}: {exc}") from None


@dataclass(frozen=True)
class ParamTarget:
    """Where one checkpoint tensor goes: `module.attr`, then `[expert]`, then the part's rows."""

    module: str
    attr: str  # weight | weight_scale_inv | e_score_correction_bias
    expert: int | None = None
    part: int | None = None


def checkpoint_to_param(name: str, cfg: ModelConfig) -> ParamTarget:
    """Checkpoint tensor name -> its place in our model (MTP renamed, experts and parts fused)."""
    m = _LAYER.match(name)
    if m and int(m.group(1)) >= cfg.num_hidden_layers:
        name = f"mtp.{int(m.group(1)) - cfg.num_hidden_layers}.{m.group(2)}"
    expert = None
    m = _EXPERT.match(name)
    if m:
        name, expert = f"{m.group(1)}.{m.group(3)}", int(m.group(2))
    module, attr = name.rsplit(".", 1)
    parent, _, proj = module.rpartition(".")
    if proj in _FUSED_PARTS:
        fused, part = _FUSED_PARTS[proj]
        return ParamTarget(f"{parent}.{fused}", attr, expert, part)
    return ParamTarget(module, attr, expert)


def destination(modules: dict[str, torch.nn.Module], target: ParamTarget) -> torch.Tensor:
    """The parameter view a checkpoint tensor is copied into."""
    module = modules[target.module]
    dst = getattr(module, target.attr)
    if target.expert is not None:
        dst = dst[target.expert]
    if target.part is not None:
        dst = dst[module.part_rows(target.part, scale=target.attr == "weight_scale_inv")]
    return dst


def _read_part(f, name: str, expected: dict, cfg: ModelConfig, parallel: ParallelContext):
    """This rank's part of tensor `name` from open file `f` (None: not held here)."""
    is_scale = name.endswith(".weight_scale_inv")
    weight = expected[name.removesuffix("_scale_inv")] if is_scale else expected[name]
    block = cfg.fp8.block_size if is_scale and cfg.fp8 else None
    try:
        shard = tensor_shard(name, weight.shape, cfg.n_routed_experts, parallel, block)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    if shard is SKIP:
        return None
    if shard is None:
        return f.get_tensor(name)
    index = [slice(None)] * len(expected[name].shape)
    index[shard.dim] = slice(shard.start, shard.stop)
    return f.get_slice(name)[tuple(index)]


def load_model(
    path: str | Path,
    dtype: str = "auto",
    device: str = "cpu",
    parallel: ParallelContext | None = None,
    cfg: ModelConfig | None = None,
) -> DeepseekV3ForCausalLM:
    """Validate and load the checkpoint at `path`; returns the model in eval mode. With
    `parallel`, only this rank's part of each tensor is read (mci/parallel/sharding.py).
    `cfg`: the checkpoint's config.json as this process's caller already parsed it."""
    path = Path(path)
    if not path.is_dir():
        raise UserError(f"model directory {path} does not exist")
    cfg = cfg or load_config(path)
    compute_dtype = resolve_dtype(dtype, cfg)
    files = find_weight_files(path)
    headers: dict[str, tuple[tuple[int, ...], str]] = {}
    for file in sorted(set(files.values())):
        headers.update(_read_header(file))

    expected = {s.name: s for s in checkpoint_layout(cfg, include_mtp=True)}
    mtp_names = {n for n in expected if n.startswith(tuple(p + "." for p in mtp_prefixes(cfg)))}
    with_mtp = bool(mtp_names) and any(n in headers for n in mtp_names)
    if mtp_names and not with_mtp:
        log.warning(
            "config declares %d MTP layer(s) but the checkpoint has no MTP weights; "
            "loading without MTP",
            cfg.num_mtp_layers,
        )
        expected = {n: s for n, s in expected.items() if n not in mtp_names}
    missing = [n for n in expected if n not in headers]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"checkpoint is missing tensor {missing[0]}{more}")
    for name, (shape, st_dtype) in headers.items():
        spec = expected.get(name)
        if spec is None:
            raise CheckpointError(f"unexpected tensor {name} in checkpoint")
        if shape != spec.shape:
            raise CheckpointError(
                f"tensor {name} has shape {list(shape)}, expected {list(spec.shape)}"
            )
        if (spec.dtype == "F8_E4M3") != (st_dtype == "F8_E4M3"):
            raise CheckpointError(f"tensor {name} has dtype {st_dtype}, expected {spec.dtype}")

    parallel = parallel or ParallelContext.single()
    try:
        with torch.device("cpu"):
            model = DeepseekV3ForCausalLM(cfg, compute_dtype, with_mtp, parallel)
    except ValueError as exc:  # a size the parallel layout cannot split
        raise UserError(str(exc)) from None
    asked = huge_pages(model.parameters())  # before the copies below first touch them
    log.info(
        "2 MB pages asked for %.0f of %.0f MB of weights", asked / 1e6, model.weight_bytes() / 1e6
    )
    modules = dict(model.named_modules())
    by_file: dict[Path, list[str]] = {}
    for name in expected:
        by_file.setdefault(files[name], []).append(name)
    for file, names in sorted(by_file.items()):
        with safe_open(file, framework="pt") as f:
            for name in names:
                tensor = _read_part(f, name, expected, cfg, parallel)
                if tensor is None:
                    continue  # another rank's expert
                target = checkpoint_to_param(name, cfg)
                if target.expert is not None:
                    expert = local_expert(target.expert, cfg.n_routed_experts, parallel)
                    target = dataclasses.replace(target, expert=expert)
                destination(modules, target).copy_(tensor)
    model.eval()
    return model.to(device)
