"""Prefill-decode disaggregation served: two prefill workers and two decode workers (`mci
serve --disaggregation-mode ...`, the tiny model) behind `mci router --pd-disaggregation`,
called with the official `openai` client, and the faults of a fleet caused for real:

- the outputs equal a decode worker's own colocated ones (it serves a request without the
  router's headers by itself), streamed or not, for completions, chat and /generate;
- a prefill worker stopped (SIGSTOP) while it holds requests: the decode worker gives up
  after --disaggregation-transfer-timeout, frees the slots, and the router retries on the
  other prefill worker: every client gets one answer;
- a prefill worker killed (SIGKILL) with requests in flight: the same, without the wait;
- a decode worker killed mid-stream: the stream resumes on the other decode worker (a new
  prefill of prompt + the tokens so far) and ends as one unbroken, exact stream.

After each, every surviving worker's pool is whole: nothing receiving, held or quarantined,
every slot free or its tree's.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import openai
import pytest
from server_helpers import LiveServer, free_port

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
try:
    import mooncake.engine  # noqa: F401
except ImportError as exc:
    if os.environ.get("CI"):
        raise
    pytest.skip(f"the Mooncake transfer engine does not load: {exc}", allow_module_level=True)

TIMEOUT_S = 2
WORKER_FLAGS = (
    "--disaggregation-transfer-timeout",
    str(TIMEOUT_S),
    "--max-total-tokens",
    "8192",
    "--served-model-name",
    "m",
)
LONG = "values = [" + ", ".join(str(i) for i in range(400)) + "]\n"


def _start_all(specs: dict) -> dict:
    """LiveServers started side by side (each waits for its own health)."""
    servers, errors = {}, []

    def start(name, args, kwargs):
        try:
            servers[name] = LiveServer(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(f"{name}: {exc}")

    threads = [threading.Thread(target=start, args=(n, *spec)) for n, spec in specs.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        for server in servers.values():
            server.stop()
        raise RuntimeError("; ".join(errors))
    return servers


@pytest.fixture(scope="module")
def fleet(checkpoint):
    path = checkpoint()
    specs = {}
    for i in (1, 2):
        bootstrap = ("--disaggregation-bootstrap-port", str(free_port()))
        specs[f"p{i}"] = ((path, "--disaggregation-mode", "prefill", *bootstrap, *WORKER_FLAGS), {})
        specs[f"d{i}"] = ((path, "--disaggregation-mode", "decode", *WORKER_FLAGS), {})
    servers = _start_all(specs)
    router = LiveServer(
        None,
        "--pd-disaggregation",
        "--prefill",
        servers["p1"].url,
        servers["p2"].url,
        "--decode",
        servers["d1"].url,
        servers["d2"].url,
        "--breaker-cooldown",
        "60",
        command="router",
    )
    servers["router"] = router
    _wait_for_bootstraps(router.url)
    yield servers
    for server in servers.values():
        server.stop()


def _wait_for_bootstraps(url: str) -> None:
    """The router reads the prefill workers' bootstrap addresses at its health checks."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        workers = httpx.get(url + "/workers", timeout=5).json()["workers"]
        if all(w["bootstrap"] for w in workers if w["role"] == "prefill"):
            return
        time.sleep(0.2)
    raise RuntimeError("the router never learned the prefill workers' bootstrap servers")


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)


def _complete(url: str, prompt: str, max_tokens: int = 12) -> str:
    out = _client(url).completions.create(
        model="m",
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    return out.choices[0].text


def _whole(*servers: LiveServer) -> None:
    for server in servers:
        state = server.wait_idle(30)
        handoff = state.get("disaggregation") or {}
        assert state["integrity_ok"], state.get("integrity_error")
        assert state["free_slots"] + state["tree_tokens"] == state["num_slots"], state
        assert state["tree_locked_tokens"] == 0
        for key in ("receiving", "held_tokens", "quarantined_slots"):
            assert not handoff.get(key), (server.url, handoff)


def test_the_pair_answers_as_a_colocated_worker(fleet):
    router, d1 = fleet["router"], fleet["d1"]
    via, alone = _client(router.url), _client(d1.url)  # alone: d1 prefills by itself
    prompts = ["def fibonacci(n):", LONG, "class Queue:\n    def push(self, x):\n"]
    for prompt in prompts:
        a = via.completions.create(model="m", prompt=prompt, max_tokens=16, temperature=0)
        b = alone.completions.create(model="m", prompt=prompt, max_tokens=16, temperature=0)
        assert a.choices[0].text == b.choices[0].text
        assert a.usage.prompt_tokens == b.usage.prompt_tokens
    seeded = {"model": "m", "prompt": prompts[2], "max_tokens": 10, "temperature": 1.0}
    a = via.completions.create(**seeded, n=2, seed=11, logprobs=2)
    b = alone.completions.create(**seeded, n=2, seed=11, logprobs=2)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    # the samples may decode in other batches than colocated ones: fp32 rounding, not bits
    for x, y in zip(a.choices, b.choices, strict=True):
        assert x.logprobs.token_logprobs == pytest.approx(y.logprobs.token_logprobs, abs=1e-5)
    messages = [{"role": "user", "content": "write a sort"}]
    chunks = via.chat.completions.create(
        model="m", messages=messages, max_tokens=14, temperature=0, stream=True
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    whole = alone.chat.completions.create(
        model="m", messages=messages, max_tokens=14, temperature=0
    )
    assert streamed == whole.choices[0].message.content
    native = {"text": prompts[0], "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
    a = httpx.post(router.url + "/generate", json=native, timeout=60).json()
    b = httpx.post(d1.url + "/generate", json=native, timeout=60).json()
    assert a["text"] == b["text"]
    # a prefill worker refuses what is not its kind: a plain worker's headers check
    bad = httpx.post(
        d1.url + "/v1/completions",
        json={"prompt": "x", "max_tokens": 2},
        headers={"X-Mci-Bootstrap-Room": "r1"},
        timeout=30,
    )
    assert bad.status_code == 400 and "decode worker" in bad.json()["error"]["message"]
    transfers = sum(
        fleet[name].state()["disaggregation"].get("transfers", 0) for name in ("d1", "d2")
    )
    assert transfers >= len(prompts) + 2 + 1 + 1
    _whole(*(fleet[n] for n in ("p1", "p2", "d1", "d2")))


def _concurrently(url: str, prompts: list[str], max_tokens: int = 8) -> list:
    results: list = [None] * len(prompts)

    def one(i: int) -> None:
        try:
            results[i] = _complete(url, prompts[i], max_tokens)
        except Exception as exc:  # noqa: BLE001 - reported by the test
            results[i] = exc

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return results


def _prefill_worker_of(fleet, prefix: str) -> LiveServer:
    """The prefill worker the router sends prompts starting with `prefix` to (cache-aware:
    the one that took the first such prompt)."""
    url = fleet["router"].url

    def counts():
        workers = httpx.get(url + "/workers", timeout=5).json()["workers"]
        return {w["url"]: w["requests"] for w in workers if w["role"] == "prefill"}

    before = counts()
    _complete(url, prefix + "# first\n", 2)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        grown = [u for u, n in counts().items() if n > before.get(u, 0)]
        if grown:
            return next(fleet[n] for n in ("p1", "p2") if fleet[n].url == grown[0])
        time.sleep(0.05)
    raise AssertionError("no prefill worker took the request")


def _setup_fault(fleet, name: str, n: int):
    """The prefill worker `n` prompts of a family go to, the other one, the prompts, their
    answers from a decode worker alone, and the router's count of prefill failures so far."""
    prefix = f"# {name}\n" + LONG
    target = _prefill_worker_of(fleet, prefix)
    other = fleet["p2"] if target is fleet["p1"] else fleet["p1"]
    prompts = [f"{prefix}# {name} {i}\n" for i in range(n)]
    want = [_complete(fleet["d2"].url, p, 8) for p in prompts]
    return target, other, prompts, want, _prefill_failures(fleet)


def _prefill_failures(fleet) -> int:
    return httpx.get(fleet["router"].url + "/workers", timeout=5).json()["pd"]["failures"]


def test_a_stalled_prefill_worker_times_out_and_another_takes_over(fleet):
    router = fleet["router"]
    p1, other, prompts, want, failures = _setup_fault(fleet, "stalled", 6)
    stalled = (p1.proc.pid, p1.state()["engine_pid"])  # the whole worker: both processes
    for pid in stalled:
        os.kill(pid, signal.SIGSTOP)
    try:
        start = time.monotonic()
        got = _concurrently(router.url, prompts)
        elapsed = time.monotonic() - start
    finally:
        for pid in stalled:
            os.kill(pid, signal.SIGCONT)
    assert got == want
    assert _prefill_failures(fleet) > failures, "no request met the stalled worker"
    assert elapsed >= TIMEOUT_S
    _whole(fleet["d1"], fleet["d2"], other)
    start = time.monotonic()
    _whole(p1)  # it runs again, and lets go at once of what nobody came for
    assert time.monotonic() - start < TIMEOUT_S


def test_a_prefill_worker_killed_mid_transfer_costs_no_request(fleet):
    router = fleet["router"]
    p1, other, prompts, want, failures = _setup_fault(fleet, "killed", 8)
    results: list = []
    runner = threading.Thread(target=lambda: results.extend(_concurrently(router.url, prompts)))
    runner.start()
    time.sleep(0.15)
    os.kill(p1.proc.pid, signal.SIGKILL)
    runner.join(120)
    assert results == want
    assert _prefill_failures(fleet) > failures, "no request was in flight on the killed worker"
    assert p1.proc.wait(10) is not None
    _whole(fleet["d1"], fleet["d2"], other)
    fleet["alive_prefill"] = other


def test_a_decode_worker_killed_mid_stream_resumes_on_the_other(fleet):
    router, d1, d2 = fleet["router"], fleet["d1"], fleet["d2"]
    prompt = "def long_function(x):\n"
    body = {"prompt": prompt, "max_tokens": 160, "temperature": 0, "ignore_eos": True}
    want = httpx.post(d2.url + "/v1/completions", json=body, timeout=120).json()
    want_text = want["choices"][0]["text"]
    pids = {server.url: server.proc.pid for server in (d1, d2)}
    text, killed = [], None
    stream = _client(router.url).completions.create(
        model="m", stream=True, prompt=prompt, max_tokens=160, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    for i, chunk in enumerate(stream):
        text.append(chunk.choices[0].text if chunk.choices else "")
        if i == 10:
            serving = [
                w["url"]
                for w in httpx.get(router.url + "/workers", timeout=5).json()["workers"]
                if w["role"] == "decode" and w["in_flight"]
            ]
            killed = serving[0]
            os.kill(pids[killed], signal.SIGKILL)
    assert killed is not None
    assert "".join(text) == want_text
    survivor = d2 if killed == d1.url else d1
    _whole(survivor, fleet.get("alive_prefill", fleet["p2"]))
