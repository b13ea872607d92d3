"""Loading real checkpoint layouts, and clear errors for every broken one."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch
from helpers import prefill_logits
from safetensors.torch import load_file, save_file

from mci.engine.config import DEFAULT_MODEL
from mci.errors import CheckpointError, ConfigError, UserError
from mci.models.loader import load_model


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _rewrite_weights(path, edit):
    file = path / "model.safetensors"
    tensors = load_file(str(file))
    edit(tensors)
    save_file(tensors, str(file), metadata={"format": "pt"})


def test_sharded_checkpoint_equals_single_file(checkpoint):
    single = load_model(checkpoint(), "float32")
    sharded_path = checkpoint(shard_max_bytes=600_000)
    assert len(list(sharded_path.glob("*.safetensors"))) > 2
    assert (sharded_path / "model.safetensors.index.json").exists()
    sharded = load_model(sharded_path, "float32")
    ids = list(range(5, 30))
    torch.testing.assert_close(
        prefill_logits(single, ids), prefill_logits(sharded, ids), rtol=0, atol=0
    )


def test_transformers5_config_dialect_loads_identically(checkpoint):
    path5 = checkpoint(config_dialect="5")
    raw = json.loads((path5 / "config.json").read_text())
    assert "rope_parameters" in raw and "topk_method" not in raw and "scoring_func" not in raw
    assert "moe_layer_freq" not in raw and "rope_scaling" not in raw
    ids = list(range(5, 30))
    torch.testing.assert_close(
        prefill_logits(load_model(path5, "float32"), ids),
        prefill_logits(load_model(checkpoint(), "float32"), ids),
        rtol=0,
        atol=0,
    )


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_dtypes_load_and_auto_means_checkpoint_dtype(checkpoint, dtype):
    model = load_model(checkpoint(dtype=dtype), "auto")
    assert model.dtype == getattr(torch, dtype)
    assert model.model.embed_tokens.weight.dtype == getattr(torch, dtype)


def test_missing_tensor_is_named(checkpoint, tmp_path):
    path = _copy(checkpoint(), tmp_path / "c")
    _rewrite_weights(path, lambda t: t.pop("model.layers.1.self_attn.kv_b_proj.weight"))
    with pytest.raises(
        CheckpointError, match=r"missing tensor model\.layers\.1\.self_attn\.kv_b_proj"
    ):
        load_model(path)


def test_unexpected_tensor_is_named(checkpoint, tmp_path):
    path = _copy(checkpoint(), tmp_path / "c")
    _rewrite_weights(path, lambda t: t.update({"model.layers.0.bogus.weight": torch.zeros(2)}))
    with pytest.raises(CheckpointError, match=r"unexpected tensor model\.layers\.0\.bogus\.weight"):
        load_model(path)


def test_shape_mismatch_is_named(checkpoint, tmp_path):
    path = _copy(checkpoint(), tmp_path / "c")
    name = "model.layers.1.mlp.experts.3.up_proj.weight"
    _rewrite_weights(path, lambda t: t.update({name: torch.zeros(7, 7)}))
    with pytest.raises(CheckpointError, match=rf"{name} has shape \[7, 7\], expected \[64, 128\]"):
        load_model(path)


def test_corrupted_header(checkpoint, tmp_path):
    path = _copy(checkpoint(), tmp_path / "c")
    data = bytearray((path / "model.safetensors").read_bytes())
    data[8:40] = b"{ this is not json at all ......"
    (path / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="corrupted safetensors file model.safetensors"):
        load_model(path)


def test_pickle_only_directory_is_refused(checkpoint, tmp_path):
    path = _copy(checkpoint(), tmp_path / "c")
    (path / "model.safetensors").unlink()
    (path / "pytorch_model.bin").write_bytes(b"\x80\x04not loaded")
    with pytest.raises(CheckpointError, match="pickle"):
        load_model(path)


def test_missing_directory_and_config(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        load_model(tmp_path / "nope")
    with pytest.raises(ConfigError, match="no config.json"):
        load_model(tmp_path)


def test_unsupported_architecture(checkpoint, tmp_path):
    path = _copy(checkpoint(), tmp_path / "c")
    raw = json.loads((path / "config.json").read_text())
    raw.update(architectures=["LlamaForCausalLM"], model_type="llama")
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="unsupported architecture 'LlamaForCausalLM'"):
        load_model(path)


def _cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "mci", *args], capture_output=True, text=True, timeout=120
    )


BREAKAGES = ("missing_dir", "missing_config", "bad_arch", "corrupt", "shape")


def _break(checkpoint, path, breakage: str) -> None:
    if breakage != "missing_dir":
        _copy(checkpoint(), path)
    if breakage == "missing_config":
        (path / "config.json").unlink()
    elif breakage == "bad_arch":
        (path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    elif breakage == "corrupt":
        (path / "model.safetensors").write_bytes(b"\xff" * 64)
    elif breakage == "shape":
        _rewrite_weights(path, lambda t: t.update({"model.norm.weight": torch.zeros(3)}))


def test_cli_reports_user_errors_in_one_line_with_exit_code_2(checkpoint, tmp_path):
    """Each breakage of a checkpoint, through `mci generate` (the five run side by side: each
    is mostly the interpreter's start)."""
    runs = {}
    for breakage in BREAKAGES:
        path = tmp_path / breakage
        _break(checkpoint, path, breakage)
        argv = ["generate", "--model-path", str(path), "--prompt", "hi", "--max-new-tokens", "2"]
        runs[breakage] = subprocess.Popen(
            [sys.executable, "-m", "mci", *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    for breakage, run in runs.items():
        _, stderr = run.communicate(timeout=180)
        assert run.returncode == 2, (breakage, stderr)
        lines = [line for line in stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("mci: error: "), (breakage, stderr)
        assert "Traceback" not in stderr


def test_cli_bad_flag_is_one_line():
    result = _cli("generate", "--prompt", "x", "--max-new-tokens", "-3")
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "command, device",
    [
        (["serve"], "foo"),
        (["serve"], "cuda"),
        (["serve"], "mps"),
        (["bench", "floors", "--shape", "x=1,2,3"], "cuda:7"),
    ],
)
def test_cli_device_this_torch_cannot_use_is_one_line(command, device):
    """--device names a device this process's torch can compute on, or the CLI says so in one
    line (exit 2) before an engine starts: no traceback from the engine process."""
    if device.startswith("cuda") and torch.cuda.device_count() > int(device[5:] or 0):
        pytest.skip(f"this machine has {device}")
    model = ["--model-path", str(DEFAULT_MODEL)]
    result = _cli(*command, *model, "--device", device)
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("mci: error: --device"), result.stderr
