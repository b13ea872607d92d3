"""The tiered prefix cache (--enable-hierarchical-cache): a prefix evicted from the KV pool is
served from host memory (L2) or the file store (L3) with outputs bit-identical to computing
it (deterministic bf16: tokens and logprobs; fp32 against an engine without tiers); a store
is shared by engines and survives them, is never read by another checkpoint, and a corrupt
page is recomputed, never served; slot accounting holds in every tier."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from engine_helpers import drive, greedy

from mci.cache.config import CacheConfig
from mci.core.request import Request
from mci.engine.builder import build_engine_core
from mci.engine.config import EngineConfig, ModelPlacement
from mci.errors import UserError
from mci.layers.linear import bf16_matmuls_supported
from mci.models.loader import load_model
from mci.scheduler.config import SchedulerConfig
from mci.tokenizer import TextTokenizer

PAGE = 16
POOL = 700  # tokens of KV pool: two long prompts do not fit beside the flood


def engine(path, model, store: Path | None, *, tiers=True, dtype="float32", **cache):
    config = EngineConfig(
        model=ModelPlacement(model_path=path, dtype=dtype, skip_kernel_warmup=True),
        cache=CacheConfig(
            **{
                "max_total_tokens": POOL,
                "enable_hierarchical_cache": tiers,
                "hicache_size": 0.05,
                "hicache_page_size": PAGE,
                "hicache_storage_backend": "file" if store else None,
                "hicache_storage_dir": str(store) if store else None,
                **cache,
            }
        ),
        scheduler=dataclasses.replace(SchedulerConfig(), max_running_requests=4),
        check_integrity=True,
    )
    return build_engine_core(config, model, TextTokenizer.load(path))


def prompt(seed: int, n: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, 1000, (n,), generator=gen).tolist()


def run(core, tag: str, ids: list[int], n: int = 6):
    """One request alone; its final output."""
    out = drive(core, {0: [Request(tag, list(ids), greedy(n, logprobs=2))]})[tag]
    return out


def flood(core, seed: int = 100):
    """Prompts enough to evict everything unlocked from the pool."""
    drive(core, {0: [Request(f"f{i}", prompt(seed + i, 300), greedy(1)) for i in range(4)]})


def same(a, b) -> bool:
    return a.output_token_ids == b.output_token_ids and a.logprobs == b.logprobs


@pytest.fixture(scope="module")
def tiny(checkpoint):
    path = checkpoint()
    return path, load_model(path, "float32")


@pytest.fixture(scope="module")
def deterministic(checkpoint):
    if not bf16_matmuls_supported():
        pytest.skip("this CPU runs no oneDNN bf16 matmuls (--deterministic needs them)")
    path = checkpoint(dtype="bfloat16")
    model = load_model(path, "bfloat16")
    model.set_batch_invariant(True)
    return path, model


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_a_prefix_from_each_tier_gives_the_computed_outputs(deterministic, tmp_path, policy):
    path, model = deterministic
    ids = prompt(1, 400)
    core = engine(path, model, tmp_path, dtype="bfloat16", hicache_write_policy=policy)
    computed = run(core, "a", ids)
    assert computed.num_cached_tokens == 0
    flood(core)  # evicts the prompt from L1: demoted to L2
    from_host = run(core, "b", ids)
    assert from_host.cached_tokens_details["host"] >= 384 - PAGE
    assert same(from_host, computed)
    core.kv.tiers.flush()
    core.close()
    if policy == "write_back":
        return  # L3 gets only what L2 evicts (test_write_back_sends_l2_evictions_to_the_store)
    fresh = engine(path, model, tmp_path, dtype="bfloat16")  # a restart: L1 and L2 are empty
    from_store = run(fresh, "c", ids)
    details = from_store.cached_tokens_details
    assert details["storage"] >= 384 - PAGE and details["device"] == 0
    assert same(from_store, computed)
    recomputed = run(engine(path, model, None, tiers=False, dtype="bfloat16"), "d", ids)
    assert same(recomputed, computed)
    fresh.close()


def test_fp32_outputs_equal_an_engine_without_tiers(tiny, tmp_path):
    path, model = tiny
    ids = prompt(2, 500)
    plain = engine(path, model, None, tiers=False)
    want = run(plain, "p", ids, n=8)
    core = engine(path, model, tmp_path)
    run(core, "a", ids, n=8)
    flood(core)
    got = run(core, "b", ids, n=8)
    assert got.cached_tokens_details["host"] > 0
    assert got.output_token_ids == want.output_token_ids
    torch.testing.assert_close(
        torch.tensor([lp for lp, _ in got.logprobs]), torch.tensor([lp for lp, _ in want.logprobs])
    )
    core.close()


def test_write_back_sends_l2_evictions_to_the_store(tiny, tmp_path):
    path, model = tiny
    core = engine(path, model, tmp_path, hicache_write_policy="write_back", hicache_size=0.0001)
    host = core.kv.tiers.host
    assert host.num_pages < 30
    ids = prompt(3, 600)
    first = run(core, "a", ids)
    flood(core)  # L1 demotes to a small L2, whose evictions go to the store
    core.kv.tiers.flush()
    stats = core.stats()["hicache"]["tiers"]
    assert stats["host"]["evictions"] > 0 and stats["storage"]["stored_pages"] > 0
    again = run(core, "b", ids)
    assert again.num_cached_tokens > 0 and again.output_token_ids == first.output_token_ids
    core.close()


def test_another_checkpoint_never_reads_the_store(checkpoint, tiny, tmp_path):
    path, model = tiny
    other_path = checkpoint(seed=7)  # the same config, other weights
    other = load_model(other_path, "float32")
    ids = prompt(4, 300)
    core = engine(path, model, tmp_path)
    run(core, "a", ids)
    core.kv.tiers.flush()
    assert list(tmp_path.rglob("*.kv"))
    stranger = engine(other_path, other, tmp_path)
    out = run(stranger, "b", ids)
    assert out.num_cached_tokens == 0
    assert core.stats()["hicache"]["tiers"]["storage"]["corrupt"] == 0
    core.close()
    stranger.close()


def test_a_corrupt_page_is_recomputed_and_deleted(tiny, tmp_path):
    path, model = tiny
    ids = prompt(5, 300)
    core = engine(path, model, tmp_path)
    want = run(core, "a", ids)
    core.kv.tiers.flush()
    core.close()
    files = sorted(tmp_path.rglob("*.kv"), key=lambda f: f.stat().st_mtime)
    victim = files[len(files) // 2]
    data = bytearray(victim.read_bytes())
    data[-5] ^= 0xFF
    victim.write_bytes(bytes(data))
    fresh = engine(path, model, tmp_path)
    got = run(fresh, "b", ids)
    stats = fresh.stats()["hicache"]["tiers"]["storage"]
    assert stats["corrupt"] == 1
    assert 0 < got.num_cached_tokens < 300 - PAGE  # the pages before the corrupt one
    assert got.output_token_ids == want.output_token_ids
    fresh.kv.tiers.flush()  # the page was deleted, computed again and written again, whole
    assert victim.read_bytes() != bytes(data)
    fresh.close()


def test_slots_stay_accounted_through_aborts_and_preemption(tiny, tmp_path):
    path, model = tiny
    core = engine(path, model, tmp_path)
    base = prompt(6, 320)
    run(core, "a", base)
    flood(core)
    # many requests sharing the prefix, more than the pool holds at once: preemption, loads
    reqs = [Request(f"r{i}", base + prompt(50 + i, 40), greedy(30)) for i in range(6)]
    for r in reqs:
        core.add_request(r)
    for _ in range(5):
        core.step()
    core.abort(reqs[0].request_id)
    while core.has_work:
        core.step()
        core.check_integrity()
    core.kv.check_integrity([])
    assert core.kv.radix.protected_tokens == 0
    core.close()


def test_flags_are_checked():
    with pytest.raises(UserError, match="--hicache-storage-dir"):
        CacheConfig(enable_hierarchical_cache=True, hicache_storage_backend="file")
    with pytest.raises(UserError, match="radix"):
        CacheConfig(enable_hierarchical_cache=True, disable_radix_cache=True)
    with pytest.raises(UserError, match="--hicache-write-policy"):
        CacheConfig(enable_hierarchical_cache=True, hicache_write_policy="later")
