"""`mci bench serve` against a live server of the bundled model (the README's `make run`)."""

from __future__ import annotations

import json
import subprocess
import sys

from server_helpers import LiveServer


def test_bench_serve_reports_and_plots(tmp_path):
    with LiveServer(None, "--max-total-tokens", "8192") as s:  # `mci serve` with no model flag
        out, png = tmp_path / "r.json", tmp_path / "r.png"
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "mci",
                "bench",
                "serve",
                "--base-url",
                s.url,
                "--num-prompts",
                "8",
                "--input-len",
                "16",
                "--output-len",
                "8",
                "--request-rate",
                "20",
                "--ignore-eos",
                "--slo-ttft-ms",
                "60000",
                "--slo-tpot-ms",
                "60000",
                "--output-json",
                str(out),
                "--plot",
                str(png),
                "--disable-tqdm",
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 0, result.stderr
        assert "TTFT (ms)" in result.stdout and "goodput" in result.stdout
        report = json.loads(out.read_text())
        assert report["completed"] == 8 and report["failed"] == 0
        assert report["output_tokens"] == 64 and report["goodput"] > 0
        for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            assert set(report[key]) == {"mean", "p50", "p90", "p99"}
        assert png.stat().st_size > 10_000


def test_bench_serve_unreachable_server_is_one_line_error():
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "mci",
            "bench",
            "serve",
            "--base-url",
            "http://127.0.0.1:9",
            "--num-prompts",
            "1",
            "--disable-tqdm",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and result.stderr.strip().startswith("mci: error:")
