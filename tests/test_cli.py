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
    def start(seed):
        return subprocess.Popen(
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
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )

    runs = [start(seed) for seed in (1, 1, 2)]  # side by side: each is mostly start-up
    first, again, other = (run.communicate(timeout=180)[0] for run in runs)
    assert first and first == again
    assert first != other


def test_generate_runs_the_engine_the_server_runs():
    """`mci generate` is the engine's build (packed weights, CPU kernels), not a driver of its
    own: on the bundled bf16 model its greedy text is the in-process Engine's, token for token
    (the bf16 roundings of the two paths would differ)."""
    from mci.cache.config import CacheConfig
    from mci.core.sampling_params import SamplingParams
    from mci.engine.config import EngineConfig, ModelPlacement
    from mci.engine.engine import Engine

    prompts = ["def fibonacci(n):", "class Stack:", "def _check_value(value):"]
    engine = Engine(
        EngineConfig(
            model=ModelPlacement(skip_kernel_warmup=True),
            cache=CacheConfig(max_total_tokens=4096),
        ),
        background=False,
    )
    try:
        params = SamplingParams(max_new_tokens=48, temperature=0, ignore_eos=True)
        texts = [r.outputs[0].text for r in engine.generate(prompts, params)]
    finally:
        engine.shutdown()
    for prompt, text in zip(prompts, texts, strict=True):
        result = subprocess.run(
            [sys.executable, "-m", "mci", "generate", "--prompt", prompt]
            + ["--max-new-tokens", "48", "--ignore-eos", "--skip-kernel-warmup"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 0, result.stderr
        assert result.stdout == prompt + text + "\n"
