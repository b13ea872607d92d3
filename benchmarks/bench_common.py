"""Shared by the benchmark scripts: the `small` checkpoint and the HF reference model."""

from __future__ import annotations

from pathlib import Path

import torch

from mci.tools.make_checkpoint import make_checkpoint, preset_config


def small_checkpoint(checkpoint_dir: Path, dtype: str, size: str = "small") -> Path:
    """The seeded `size` checkpoint in `dtype`, written on first use."""
    path = checkpoint_dir / f"{size}-{dtype}"
    if not (path / "config.json").exists():
        make_checkpoint(path, preset_config(size), seed=0, dtype=dtype)
    return path


def load_hf(path: Path, dtype: str):
    """transformers' DeepseekV3ForCausalLM on the same checkpoint (the baseline)."""
    import transformers
    from transformers import DeepseekV3ForCausalLM

    transformers.logging.set_verbosity_error()
    return DeepseekV3ForCausalLM.from_pretrained(str(path), dtype=getattr(torch, dtype)).eval()
