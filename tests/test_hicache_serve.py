"""The tiered prefix cache through `mci serve` and `mci router`: two replicas sharing one file
store (a prefix computed on one is a hit on the other, reported in the official client's
`usage.prompt_tokens_details.cached_tokens` and in /generate's per-tier details), a warm
store after the engine is SIGKILLed, the router knowing the store is shared, the tiers'
metrics, and a full disk that turns the store off while serving goes on."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import httpx
import openai
import pytest
import torch
from server_helpers import LiveServer

PAGE = 16


def tier_flags(store) -> tuple[str, ...]:
    return (
        "--max-total-tokens", "800",
        "--enable-hierarchical-cache",
        "--hicache-size", "0.01",
        "--hicache-page-size", str(PAGE),
        "--hicache-storage-backend", "file",
        "--hicache-storage-dir", str(store),
    )  # fmt: skip


def ids(seed: int, n: int = 400) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, 1000, (n,), generator=gen).tolist()


def metric(server: LiveServer, name: str, labels: str = "") -> float:
    return server.metric(name + (f"{{{labels}}}" if labels else " "))


def wait_stored(server: LiveServer, pages: int, timeout_s: float = 20) -> None:
    """Until the store has taken `pages` pages (its writes run behind the requests)."""
    deadline = time.monotonic() + timeout_s
    while metric(server, "mci:hicache_stored_pages_total", 'tier="storage"') < pages:
        assert time.monotonic() < deadline, "the store took too long to write"
        time.sleep(0.1)


def complete(client: openai.OpenAI, prompt: list[int]):
    return client.completions.create(
        model="m", prompt=prompt, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )


@pytest.fixture(scope="module")
def pair(checkpoint, tmp_path_factory):
    store = tmp_path_factory.mktemp("store")
    path = checkpoint()
    flags = ("--served-model-name", "m", *tier_flags(store))
    with LiveServer(path, *flags) as a, LiveServer(path, *flags) as b:
        yield a, b, store


def test_a_prefix_computed_on_one_replica_is_a_hit_on_the_other(pair):
    a, b, _ = pair
    prompt = ids(1)
    first = complete(openai.OpenAI(base_url=a.url + "/v1", api_key="x"), prompt)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    wait_stored(a, len(prompt) // PAGE - 1)
    second = complete(openai.OpenAI(base_url=b.url + "/v1", api_key="x"), prompt)
    assert second.usage.prompt_tokens_details.cached_tokens >= len(prompt) - PAGE
    assert second.choices[0].text == first.choices[0].text
    native = httpx.post(
        b.url + "/generate",
        json={"input_ids": prompt, "sampling_params": {"max_new_tokens": 2, "temperature": 0}},
        timeout=60,
    ).json()["meta_info"]
    assert native["cached_tokens"] >= len(prompt) - PAGE
    assert set(native["cached_tokens_details"]) == {"device", "host", "storage"}
    assert metric(b, "mci:hicache_hit_tokens_total", 'tier="storage"') >= len(prompt) - PAGE
    assert metric(b, "mci:hicache_storage_enabled") == 1.0
    state = b.wait_idle()
    assert state["integrity_ok"] and state["hicache"]["tiers"]["storage"]["corrupt"] == 0
    assert state["free_slots"] + state["tree_tokens"] == state["num_slots"]


def test_the_store_is_warm_after_the_engine_is_killed(pair):
    a, _, _ = pair
    client = openai.OpenAI(base_url=a.url + "/v1", api_key="x")
    prompt = ids(2)
    before = metric(a, "mci:hicache_stored_pages_total", 'tier="storage"')
    first = complete(client, prompt)
    wait_stored(a, before + len(prompt) // PAGE - 1)
    os.kill(a.state()["engine_pid"], signal.SIGKILL)
    deadline = time.monotonic() + 60
    while True:  # the supervisor restarts the engine: L1 and L2 are gone, L3 is not
        try:
            if httpx.get(a.url + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "not healthy 60 s after the kill"
        time.sleep(0.2)
    again = complete(client, prompt)
    assert again.usage.prompt_tokens_details.cached_tokens >= len(prompt) - PAGE
    assert again.choices[0].text == first.choices[0].text


def test_the_router_knows_the_store_is_shared(pair):
    a, b, _ = pair
    with LiveServer(
        None, "--worker-urls", a.url, b.url, "--health-check-interval", "0.2", command="router"
    ) as router:
        deadline = time.monotonic() + 10
        while True:
            workers = httpx.get(router.url + "/workers", timeout=5).json()["workers"]
            stores = {w["hicache_store"] for w in workers}
            if None not in stores or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert len(stores) == 1 and None not in stores
        client = openai.OpenAI(base_url=router.url + "/v1", api_key="x")
        prompt = ids(3)
        out = complete(client, prompt)
        assert out.usage.prompt_tokens_details.cached_tokens == 0


@pytest.fixture
def tiny_disk(tmp_path):
    """A 64 KiB filesystem (tmpfs): the store fills it at once."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)], capture_output=True
    )
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_full_disk_turns_the_store_off_and_serving_goes_on(checkpoint, tiny_disk):
    path = checkpoint()
    with LiveServer(path, "--served-model-name", "m", *tier_flags(tiny_disk)) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x")
        outs = [complete(client, ids(10 + i)) for i in range(3)]
        assert all(o.choices[0].finish_reason == "length" for o in outs)
        deadline = time.monotonic() + 20
        while metric(server, "mci:hicache_storage_enabled") != 0.0:
            assert time.monotonic() < deadline, "the store was not disabled"
            time.sleep(0.1)
        assert metric(server, "mci:hicache_storage_write_failures_total") == 1.0
        state = server.wait_idle()
        assert "ENOSPC" in state["hicache"]["tiers"]["storage"]["disabled_reason"]
        # the router must not count on a store this replica no longer writes
        assert httpx.get(server.url + "/server_info").json()["hicache_store"] is None
        again = complete(client, ids(10))  # L2 still serves it
        assert again.usage.prompt_tokens_details.cached_tokens > 0
        assert again.choices[0].text == outs[0].choices[0].text
