"""The README's run command: `mci generate` on the bundled default model."""

from __future__ import annotations

import subprocess
import sys

from mci.cli import DEFAULT_MODEL
from mci.models.loader import load_model


def test_bundled_default_model_loads():
    model = load_model(DEFAULT_MODEL)
    assert model.cfg.num_mtp_layers == 1 and len(model.mtp) == 1


def test_generate_with_default_model_prints_text_and_timing():
    prompt = "def fibonacci(n):"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "mci",
            "generate",
            "--prompt",
            prompt,
            "--max-new-tokens",
            "16",
            "--ignore-eos",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(prompt) and len(result.stdout) > len(prompt) + 5
    summary = [line for line in result.stderr.splitlines() if line.startswith("[mci]")]
    assert len(summary) == 1 and "prefill" in summary[0] and "decode 16 tokens" in summary[0]


def test_seeded_sampling_is_reproducible():
    def run(seed):
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "mci",
                "generate",
                "--prompt",
                "import os",
                "--max-new-tokens",
                "12",
                "--temperature",
                "1.0",
                "--seed",
                str(seed),
                "--ignore-eos",
            ],
            capture_output=True,
            text=True,
            timeout=120,
        ).stdout

    assert run(1) == run(1)
    assert run(1) != run(2)
