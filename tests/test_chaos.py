"""CI's short run of the chaos and soak suite (scripts/chaos.py; `make chaos` runs it with the
10-minute soak): disconnect storm, 10x overload, malformed and fuzzed bodies, SIGTERM /
SIGKILL / SIGSTOP of the engine under load, a 20-second mixed soak from 48 clients, and
SIGTERM of the server with requests in flight. Every check of the run must pass, the memory
checks of the soak included: the engine's RSS grows < 5% after the soak's first quarter and
stays under the memory plan it states at start (so the server warms its kernels, as a
served engine does)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parent.parent / "scripts" / "chaos.py"


def test_short_chaos_run_passes(tmp_path):
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--soak-seconds", "20", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    report_path = tmp_path / "chaos.json"
    assert report_path.exists(), run.stdout + run.stderr
    report = json.loads(report_path.read_text())
    failed = {k: v for k, v in report.items() if isinstance(v, dict) and not v.get("ok", True)}
    assert report["ok"] and run.returncode == 0, json.dumps(failed, indent=1)[:4000]
    # the run exercised what it claims
    assert report["overload"]["counts"].get("429", 0) > 0
    assert report["engine_signals"]["SIGSTOP"]["ready_again_after_s"] is not None
    assert report["soak"]["counts"].get("200_finished", 0) > 20
    memory = report["soak"]["memory"]
    assert memory["ok"] and memory["engine_peak_bound_bytes"] > memory["engine"]["rss_peak_bytes"]
    assert (tmp_path / "chaos.png").stat().st_size > 0
