"""`mci plan` on the published DeepSeek-V3 config."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import REFERENCE_COPY, REFERENCE_DIR

from mci.errors import UserError
from mci.models.layout import checkpoint_layout
from mci.plan import make_plan, parse_gpus


def test_reference_weight_bytes_match_published_total(reference_config):
    plan = make_plan(reference_config, parse_gpus("8xH200"))
    assert plan.weight_bytes == 688_574_839_360
    assert plan.num_tensors == 91_991
    main = checkpoint_layout(reference_config, include_mtp=False)
    assert sum(s.nbytes for s in main) == 673_150_611_808
    assert plan.kv_bytes_per_token == 70_272


def test_reference_layout_matches_published_tensor_table(reference_config):
    table = REFERENCE_DIR / "tensors.tsv"
    if not table.exists():
        pytest.skip("shared/reference not present")
    ours = {s.name: (s.shape, s.dtype) for s in checkpoint_layout(reference_config)}
    rows = [
        line.split("\t")
        for line in table.read_text().splitlines()
        if line and not line.startswith("#") and not line.startswith("name\t")
    ]
    assert len(rows) > 40
    for name, shape, dtype in rows:
        assert ours[name] == (tuple(int(x) for x in shape.split(",")), dtype), name


def test_h100_has_no_room_h200_fits_hundreds_of_thousands(reference_config):
    h100 = make_plan(reference_config, parse_gpus("8xH100"), 0.9)
    assert not any(lp.fits for lp in h100.layouts)
    h200 = make_plan(reference_config, parse_gpus("8xH200"), 0.9)
    tp = h200.layouts[0]
    assert tp.fits and 100_000 <= tp.kv_tokens_per_gpu < 1_000_000
    dp = h200.layouts[1]
    assert dp.kv_tokens_total == dp.kv_tokens_per_gpu * 8 > tp.kv_tokens_total


@pytest.mark.parametrize("spec", ["8xH200", "16xH100", "8x141GB", "4x80GiB", "2x24"])
def test_gpu_specs_parse(spec):
    hw = parse_gpus(spec)
    assert hw.count >= 2 and hw.bytes_per_gpu > 10**10


@pytest.mark.parametrize("spec", ["H200", "8xZ9", "0xH100", "lots"])
def test_bad_gpu_specs(spec):
    with pytest.raises(UserError):
        parse_gpus(spec)


def test_plan_cli_prints_verdicts():
    config = REFERENCE_DIR / "config.json" if REFERENCE_DIR.exists() else REFERENCE_COPY

    def run(gpus):
        return subprocess.run(
            [sys.executable, "-m", "mci", "plan", "--config", str(config), "--gpus", gpus],
            capture_output=True,
            text=True,
            timeout=60,
        )

    ok, no = run("8xH200"), run("8xH100")
    assert ok.returncode == 0 and "688,574,839,360" in ok.stdout and "70,272" in ok.stdout
    assert "verdict: FITS" in ok.stdout
    assert no.returncode == 0 and "verdict: DOES NOT FIT" in no.stdout
