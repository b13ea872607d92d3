"""A live server under load and failure: concurrency, dropped clients, overload, SIGTERM,
a dead engine, a dead front end."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import httpx
import openai
import pytest
from server_helpers import LiveServer


def _stream_body(max_tokens: int, prompt: str = "def main():") -> dict:
    return {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "stream": True,
        "temperature": 0,
        "ignore_eos": True,
    }


def test_64_concurrent_streams_complete(checkpoint):
    with LiveServer(
        checkpoint(), "--max-total-tokens", "16384", "--served-model-name", "default-model"
    ) as s:
        client = openai.AsyncOpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0)

        async def one(i: int):
            stream = await client.completions.create(
                model="default-model",
                prompt=f"item {i}:",
                max_tokens=16,
                stream=True,
                temperature=0,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
            text, usage, reason = "", None, None
            async for chunk in stream:
                if chunk.choices:
                    text += chunk.choices[0].text
                    reason = chunk.choices[0].finish_reason or reason
                if chunk.usage:
                    usage = chunk.usage
            return text, usage.completion_tokens, reason

        async def main():
            return await asyncio.gather(*(one(i) for i in range(64)))

        results = asyncio.run(main())
        assert all(tokens == 16 and reason == "length" for _, tokens, reason in results)
        # greedy: the same prompt alone gives the same text
        solo = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0)
        model = solo.models.list().data[0].id
        alone = solo.completions.create(
            model=model,
            prompt="item 7:",
            max_tokens=16,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert results[7][0] == alone.choices[0].text
        state = s.wait_idle()
        assert state["integrity_ok"] and state["kv_cache_usage"] == 0


@pytest.mark.slow  # CI: tests/test_chaos.py's disconnect storm (scripts/chaos.py)
def test_200_cut_streams_leave_kv_free(checkpoint):
    with LiveServer(checkpoint(), "--max-total-tokens", "32768") as s:

        async def cut(i: int):
            async with httpx.AsyncClient(timeout=30) as c:
                async with c.stream(
                    "POST", s.url + "/v1/completions", json=_stream_body(500, f"line {i}")
                ) as r:
                    assert r.status_code == 200
                    seen = 0
                    async for line in r.aiter_lines():
                        if line.startswith("data:"):
                            seen += 1
                            if seen >= 2:
                                break  # leave mid-stream: the connection closes

        async def main():
            sem = asyncio.Semaphore(50)

            async def limited(i):
                async with sem:
                    await cut(i)

            await asyncio.gather(*(limited(i) for i in range(200)))

        asyncio.run(main())
        state = s.wait_idle(timeout_s=30)
        assert state["in_flight"] == 0 and state["num_running"] == 0
        assert state["kv_cache_usage"] == 0 and state["tree_locked_tokens"] == 0
        assert state["integrity_ok"]
        assert state["free_slots"] + state["tree_tokens"] == state["num_slots"]
        metrics = httpx.get(s.url + "/metrics").text
        aborted = float(
            next(
                line.split()[-1]
                for line in metrics.splitlines()
                if line.startswith("mci:requests_aborted_total")
            )
        )
        assert aborted >= 150  # nearly all were cut long before 500 tokens


@pytest.mark.slow  # CI: tests/test_chaos.py's overload (scripts/chaos.py)
def test_flood_beyond_queue_gets_429_and_admitted_complete(checkpoint):
    with LiveServer(
        checkpoint(),
        "--max-total-tokens",
        "8192",
        "--max-running-requests",
        "2",
        "--max-queued-requests",
        "2",
    ) as s:

        async def one(c, i):
            r = await c.post(
                s.url + "/v1/completions",
                json={"prompt": f"q{i}", "max_tokens": 40, "temperature": 0, "ignore_eos": True},
            )
            return r

        async def main():
            async with httpx.AsyncClient(timeout=60) as c:
                return await asyncio.gather(*(one(c, i) for i in range(30)))

        responses = asyncio.run(main())
        codes = [r.status_code for r in responses]
        assert codes.count(429) > 0 and codes.count(200) >= 4
        assert set(codes) <= {200, 429}
        for r in responses:
            if r.status_code == 429:
                assert r.headers["retry-after"] == "1"
                assert r.json()["error"]["code"] == "rate_limit_exceeded"
            else:
                assert r.json()["usage"]["completion_tokens"] == 40
        assert "mci:requests_rejected_total" in httpx.get(s.url + "/metrics").text


def test_sigterm_drains_in_flight_streams_then_exits_0(checkpoint):
    s = LiveServer(checkpoint(), "--max-total-tokens", "8192", "--drain-timeout", "60")
    try:
        results, errors = [], []

        def stream(i):
            try:
                with httpx.stream(
                    "POST", s.url + "/v1/completions", timeout=60, json=_stream_body(400, f"s{i}")
                ) as r:
                    finish = None
                    for line in r.iter_lines():
                        if line.startswith("data:") and 'finish_reason": "length' in line:
                            finish = "length"
                    results.append(finish)
            except Exception as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 20
        while s.state()["in_flight"] < 6 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert s.state()["in_flight"] == 6  # 400-token streams: far from done
        os.kill(s.proc.pid, signal.SIGTERM)
        time.sleep(0.1)
        assert httpx.get(s.url + "/health").status_code == 503
        late = httpx.post(s.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert late.status_code == 503
        for t in threads:
            t.join(60)
        assert s.proc.wait(60) == 0
        assert not errors and results == ["length"] * 6
    finally:
        s.stop()


def test_dead_engine_fails_requests_and_health(checkpoint):
    """Without restarts (--max-engine-restarts 0) a dead engine stays down: requests in
    flight fail at once, /health is 503, new requests get 503."""
    flags = ("--max-total-tokens", "8192", "--max-engine-restarts", "0")
    with LiveServer(checkpoint(), *flags) as s:
        engine_pid = s.state()["engine_pid"]
        outcome = {}

        def long_request():
            r = httpx.post(
                s.url + "/v1/completions",
                timeout=60,
                json={"prompt": "x", "max_tokens": 2000, "ignore_eos": True},
            )
            outcome["status"], outcome["body"] = r.status_code, r.json()

        t = threading.Thread(target=long_request)
        t.start()
        time.sleep(1.0)
        os.kill(engine_pid, signal.SIGKILL)
        start = time.monotonic()
        t.join(10)
        assert not t.is_alive() and time.monotonic() - start < 5
        assert outcome["status"] == 503 and "engine" in outcome["body"]["error"]["message"]
        assert httpx.get(s.url + "/health").status_code == 503
        again = httpx.post(s.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert again.status_code == 503


def test_dead_front_end_takes_the_engine_down(checkpoint):
    s = LiveServer(checkpoint(), "--max-total-tokens", "2048")
    engine_pid = s.state()["engine_pid"]
    s.stop(signal.SIGKILL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(engine_pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        os.kill(engine_pid, signal.SIGKILL)
        pytest.fail("engine process outlived its front end")
