"""Engine crash recovery in `mci serve`: a SIGKILLed engine is restarted; requests that had
not produced output are resent and complete; the one that was streaming fails with a clear
error; /health is green again within a bound; the restart is counted."""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest
from server_helpers import LiveServer, long_request_then_queued
from server_helpers import complete_into as _complete

PROMPTS = [f"def task_{i}(x):" for i in range(4)]


@pytest.mark.slow  # CI: the same path through a hang (test_watchdog.py) and chaos's SIGKILL
def test_engine_killed_under_load_restarts_and_finishes_queued_requests(checkpoint):
    path = checkpoint()
    flags = ("--max-running-requests", "1", "--max-total-tokens", "4096")
    with LiveServer(path, *flags) as server:
        reference = {}
        for i, p in enumerate(PROMPTS):
            _complete(server.url, p, 8, reference, i)
        engine_pid = server.state()["engine_pid"]
        results: dict = {}
        long, queued = long_request_then_queued(server.url, PROMPTS, results)
        os.kill(engine_pid, signal.SIGKILL)
        killed = time.monotonic()
        long.join(10)
        status, body, _ = results["long"]
        assert status in (500, 503) and "already produced output" in body["error"]["message"]
        deadline = killed + 30
        while httpx.get(server.url + "/health").status_code != 200:
            assert time.monotonic() < deadline, "not healthy 30 s after the crash"
            time.sleep(0.1)
        recovered_s = time.monotonic() - killed
        for t in queued:
            t.join(60)
        for i in range(len(PROMPTS)):
            status, body, _ = results[i]
            assert status == 200, body
            assert body["choices"][0]["text"] == reference[i][1]["choices"][0]["text"]
        assert server.state()["engine_pid"] != engine_pid
        metrics = httpx.get(server.url + "/metrics").text
        assert "mci:engine_restarts_total 1.0" in metrics
        state = server.wait_idle()
        assert state["free_slots"] + state["tree_tokens"] == state["num_slots"]
    print(f"healthy again {recovered_s:.1f} s after SIGKILL")
