"""Shared fixtures: seeded random checkpoints (cached per session) and the HF reference."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path

import pytest
import torch

from mci.model_config import load_config
from mci.tools.make_checkpoint import make_checkpoint, preset_config

torch.set_num_threads(2)
# Engines and servers built by tests pass --skip-kernel-warmup (skip_kernel_warmup=True): the
# warm-up costs seconds per engine, and no test times first requests.
# tests/test_packed_weights.py runs the warm-up itself.

REFERENCE_DIR = Path(__file__).resolve().parents[2] / "shared" / "reference" / "deepseek-v3"
# A copy inside the repo keeps tests runnable without ../shared (e.g. a bare clone elsewhere).
REFERENCE_COPY = Path(__file__).parent / "data" / "deepseek-v3-config.json"


def device_under_test() -> torch.device:
    """Where the parity suites run mci and transformers: $MCI_TEST_DEVICE (default cpu;
    `make test-gpu` sets cuda). Results are compared on the CPU."""
    return torch.device(os.environ.get("MCI_TEST_DEVICE", "cpu"))


def pytest_configure(config):
    """A device this machine lacks stops the run at once, with the reason (never skips)."""
    try:
        device = device_under_test()
    except RuntimeError as e:
        raise pytest.UsageError(f"MCI_TEST_DEVICE: {e}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise pytest.UsageError(
            f"MCI_TEST_DEVICE={device} but torch {torch.__version__} sees no CUDA device"
        )


@pytest.fixture(scope="session")
def reference_config():
    """The published DeepSeek-V3 671B config."""
    return load_config(REFERENCE_DIR if REFERENCE_DIR.exists() else REFERENCE_COPY)


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """checkpoint(size="tiny", seed=0, dtype="float32", fp8=False, ..., markup=False,
    **config_overrides) -> dir (markup: DeepSeek-V3's tool/think tokens and tool template).

    Identical requests within a test session share one directory.
    """
    cache: dict[str, object] = {}

    def make(
        size="tiny",
        seed=0,
        dtype="float32",
        fp8=False,
        include_mtp=True,
        shard_max_bytes=None,
        config_dialect="4",
        bias_std=0.05,
        markup=False,
        **overrides,
    ):
        cfg = preset_config(size, **overrides)
        key_src = json.dumps(
            [
                dataclasses.asdict(cfg),
                seed,
                dtype,
                fp8,
                include_mtp,
                shard_max_bytes,
                config_dialect,
                bias_std,
                markup,
            ],
            sort_keys=True,
            default=str,
        )
        key = hashlib.sha1(key_src.encode()).hexdigest()[:16]
        if key not in cache:
            out = tmp_path_factory.mktemp(f"ckpt-{size}-{key}")
            cache[key] = make_checkpoint(
                out,
                cfg,
                seed=seed,
                dtype=dtype,
                fp8=fp8,
                include_mtp=include_mtp,
                shard_max_bytes=shard_max_bytes,
                config_dialect=config_dialect,
                bias_std=bias_std,
                tokenizer_corpus_bytes=300_000,
                markup=markup,
            )
        return cache[key]

    return make


def load_hf_reference(path, dtype=torch.float32, device=None):
    """transformers' DeepseekV3ForCausalLM on the same checkpoint (the MTP layer is ignored),
    on `device` (default: the device under test)."""
    import transformers
    from transformers import DeepseekV3ForCausalLM

    transformers.logging.set_verbosity_error()
    model = DeepseekV3ForCausalLM.from_pretrained(str(path), dtype=dtype).eval()
    return model.to(device or device_under_test())


def hf_greedy(hf, prompt_ids: list[int], n: int) -> list[int]:
    """Exactly n greedy tokens from a transformers model after `prompt_ids` (EOS ignored)."""
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt_ids], device=hf.device),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt_ids) :].cpu().tolist()
