"""The engine's configuration: which model where (`ModelPlacement`), and `EngineConfig`, the
frozen sections every part of the engine takes its own share of (cache, scheduler,
speculative decoding, parallel layout; each lives with its owner and checks itself).
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from mci.cache.config import CacheConfig
from mci.config_fields import add_flags, check_choices, from_args, option
from mci.disaggregation.config import DisaggregationConfig
from mci.errors import UserError
from mci.parallel.config import ParallelConfig
from mci.scheduler.config import SchedulerConfig
from mci.speculative.config import SpeculativeConfig

DEFAULT_MODEL = Path(__file__).parent.parent / "assets" / "default-model"


@dataclass(frozen=True)
class ModelPlacement:
    """Which checkpoint, in which dtype, on which device, computed how."""

    model_path: Path = option(DEFAULT_MODEL, "checkpoint directory (default: the bundled model)")
    dtype: str = option(
        "auto",
        "activation dtype; auto = the checkpoint's",
        ["auto", "bfloat16", "float16", "float32"],
    )
    device: str = option("cpu", "torch device (cpu, cuda, cuda:1, ...)")
    deterministic: bool = option(
        False,
        "batch-invariant inference: each request's outputs and logprobs bit-identical whatever "
        "else is batched with it, its prefill chunking or its prefix cache hits (bf16 on the "
        "CPU); also spelled --enable-deterministic-inference",
        aliases=("--enable-deterministic-inference",),
    )
    skip_kernel_warmup: bool = option(
        False,
        "CPU: skip running every matmul shape once at startup (oneDNN compiles a kernel per "
        "shape, ~3 ms each; without the warm-up the first requests of each size pay it)",
    )
    cpu_threads: str = option(
        "auto",
        "CPU: threads the engine computes with; auto = as many as it has CPUs free now, read "
        "again every 0.5 s (fewer while other processes or a CPU quota take cores; "
        "mci/engine/cpu_threads.py), or a fixed number",
    )

    def __post_init__(self):
        check_choices(self)
        check_device(self.device)
        if self.cpu_threads != "auto" and not (
            str(self.cpu_threads).isdigit() and int(self.cpu_threads) > 0
        ):
            raise UserError(
                f"--cpu-threads must be auto or a positive number, got {self.cpu_threads!r}"
            )


def check_device(name: str) -> None:
    """A --device this process's torch can compute on: a one-line error here, where the
    engine process would otherwise die on it with a traceback while starting."""
    import torch

    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise UserError(
            f"--device {name!r} is not a torch device (cpu, cuda, cuda:1, ...)"
        ) from None
    if device.type == "cpu":
        return
    if device.type != "cuda":
        raise UserError(f"--device {name}: mci runs on cpu or cuda")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise UserError(f"--device {name}: torch {torch.__version__} sees no CUDA device")
    if device.index is not None and device.index >= count:
        raise UserError(f"--device {name}: torch sees {count} CUDA device(s)")


@dataclass(frozen=True)
class EngineConfig:
    """Everything an engine needs; each part receives only its own section."""

    model: ModelPlacement = field(default_factory=ModelPlacement)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    disaggregation: DisaggregationConfig = field(default_factory=DisaggregationConfig)
    check_integrity: bool = False  # verify slot accounting every step (tests)

    def __post_init__(self):
        if self.speculative.enabled and self.parallel.enable_dp_attention:
            raise UserError(
                "--speculative-algorithm with --enable-dp-attention is not supported: drafts "
                "would add forwards on some ranks only, and the ranks step together"
            )
        if self.disaggregation.enabled:
            if self.speculative.speculative_algorithm == "mtp":
                raise UserError(
                    "--disaggregation-mode with --speculative-algorithm mtp is not supported: "
                    "the MTP module's latents and state would have to travel too (ngram works)"
                )
            if self.parallel.world_size > 1:
                raise UserError(
                    "--disaggregation-mode runs in one process for now (each rank's KV "
                    "would travel on its own)"
                )


# the sections an engine command's flags come from, by EngineConfig's field names
SECTIONS = {
    "model": ModelPlacement,
    "cache": CacheConfig,
    "scheduler": SchedulerConfig,
    "speculative": SpeculativeConfig,
    "parallel": ParallelConfig,
    "disaggregation": DisaggregationConfig,
}


def add_engine_flags(parser: argparse.ArgumentParser, sections=tuple(SECTIONS)) -> None:
    """The flags of the named engine sections (all of them by default)."""
    add_flags(parser, *(SECTIONS[name] for name in sections))


def engine_config_from_args(args: argparse.Namespace, sections=tuple(SECTIONS)) -> EngineConfig:
    """The EngineConfig of parsed flags; sections without flags keep their defaults."""
    return EngineConfig(**{name: from_args(SECTIONS[name], args) for name in sections})


def engine_config_from_fields(values: dict) -> EngineConfig:
    """An EngineConfig from field names of any section, as a program names them
    (`model_path=..., dtype="bfloat16", max_total_tokens=8192`); an unknown name is an error."""
    left = dict(values)
    sections = {}
    for name, section in SECTIONS.items():
        fields = {f.name for f in dataclasses.fields(section)} & set(left)
        sections[name] = section(**{f: left.pop(f) for f in fields})
    if left:
        raise UserError(f"unknown engine setting(s): {', '.join(sorted(left))}")
    return EngineConfig(**sections)
