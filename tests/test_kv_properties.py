"""Property tests: any sequence of admissions, allocations, caching, releases and evictions
keeps the slot pool and radix tree consistent, and ends with every slot free or the tree's."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from mci.cache.kv_manager import KVCacheManager
from mci.cache.radix_cache import RadixCache, _common_length
from mci.cache.slot_pool import OutOfSlotsError, SlotPool
from mci.core.request import Request
from mci.core.sampling_params import SamplingParams

POOL = 64
# A tiny alphabet makes shared prefixes, splits and duplicate insertions common.
tokens = st.lists(st.integers(0, 3), min_size=1, max_size=12)


class KVMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.pool = SlotPool(POOL)
        self.kv = KVCacheManager(self.pool, RadixCache(self.pool))
        self.active: list[Request] = []
        self.count = 0

    @rule(prompt=tokens)
    def admit(self, prompt):
        req = Request(f"r{self.count}", prompt, SamplingParams(max_new_tokens=4))
        self.count += 1
        self.kv.match(req)
        if self.kv.allocate(req, req.num_uncomputed):
            self.active.append(req)
        else:
            self.kv.release(req)

    @precondition(lambda self: self.active)
    @rule(data=st.data())
    def compute_and_cache(self, data):
        req = data.draw(st.sampled_from(self.active))
        req.num_computed_tokens = req.num_slots
        self.kv.cache_prefix(req)

    @precondition(lambda self: self.active)
    @rule(data=st.data(), token=st.integers(0, 3))
    def decode_one(self, data, token):
        req = data.draw(st.sampled_from(self.active))
        req.num_computed_tokens = req.num_slots
        if len(req.output_ids) < req.params.max_new_tokens and self.kv.allocate(req, 1):
            req.append_token(token)

    @precondition(lambda self: self.active)
    @rule(data=st.data(), computed=st.booleans())
    def release(self, data, computed):
        req = data.draw(st.sampled_from(self.active))
        if computed:
            req.num_computed_tokens = req.num_slots
        self.kv.release(req)
        self.active.remove(req)

    @rule(n=st.integers(1, POOL))
    def evict(self, n):
        before = self.pool.num_free
        freed = self.kv.radix.evict(n)
        assert self.pool.num_free == before + freed

    @invariant()
    def consistent(self):
        self.kv.check_integrity(self.active)
        for req in self.active:  # a request's cached prefix is still what the tree holds
            slots, _ = self.kv.radix.match_prefix(req.token_ids[: req.cached_len])
            assert torch.equal(slots, req.slots[: req.cached_len])

    def teardown(self):
        for req in list(self.active):
            self.kv.release(req)
        self.kv.check_integrity([])
        assert self.kv.radix.protected_tokens == 0
        self.kv.radix.evict(POOL)
        assert self.pool.num_free == POOL


TestKVMachine = KVMachine.TestCase
TestKVMachine.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def test_pool_detects_double_free_and_loss():
    pool = SlotPool(8)
    a = pool.alloc(3)
    with pytest.raises(AssertionError, match="integrity"):
        pool.check_integrity([])  # 3 slots unaccounted for
    pool.check_integrity([a])
    pool.free(a)
    with pytest.raises(AssertionError, match="integrity"):
        pool.check_integrity([a])  # both free and owned
    with pytest.raises(OutOfSlotsError):
        pool.alloc(9)


def test_pool_alloc_into_takes_nothing_when_the_copy_fails():
    """`alloc_into` copies the slots first and pops them after: a destination of the wrong
    shape raises and leaves every slot free; a good one gets the slots `alloc` would give."""
    pool, twin = SlotPool(8), SlotPool(8)
    with pytest.raises(RuntimeError):
        pool.alloc_into(torch.empty(3, 2, dtype=torch.long))
    assert pool.num_free == 8
    out = torch.empty(3, dtype=torch.long)
    pool.alloc_into(out)
    assert pool.num_free == 5 and torch.equal(out, twin.alloc(3))


def test_radix_split_and_lru_eviction():
    pool = SlotPool(16)
    tree = RadixCache(pool)
    assert tree.insert([1, 2, 3, 4], pool.alloc(4)) == 0
    dup = pool.alloc(3)
    assert tree.insert([1, 2, 9], dup) == 2  # [1 2] was cached: the tree adopts only [9]
    pool.free(dup[:2])
    pool.check_integrity(tree.owned_slots())
    slots, node = tree.match_prefix([1, 2, 3, 7])  # splits the [3 4] edge
    assert len(slots) == 3 and tree.total_tokens == 5
    tree.inc_lock(node)
    assert tree.evict(100) == 2  # [4] and [9] go; the locked path [1 2 3] stays
    assert tree.total_tokens == 3 and tree.protected_tokens == 3
    tree.dec_lock(node)
    assert tree.evict(100) == 3 and tree.total_tokens == 0
    assert pool.num_free == 16


def test_pool_sizing_from_tokens_gib_or_free_memory():
    from mci.cache.config import CacheConfig
    from mci.cache.sizing import kv_pool_tokens
    from mci.errors import UserError

    cpu = torch.device("cpu")
    assert kv_pool_tokens(CacheConfig(max_total_tokens=123), 1000, cpu, cap=10) == 123
    assert kv_pool_tokens(CacheConfig(kv_cache_gb=1.0), 2**20, cpu, cap=10**9) == 1024
    from_free = kv_pool_tokens(CacheConfig(mem_fraction_static=0.01), 70_272, cpu, cap=50_000)
    assert 1 <= from_free <= 50_000
    # the section checks itself: a bad size never reaches the sizing
    for bad in ({"max_total_tokens": 0}, {"kv_cache_gb": -1.0}, {"mem_fraction_static": 0}):
        with pytest.raises(UserError):
            CacheConfig(**bad)


@given(
    st.lists(st.integers(0, 3), max_size=64),
    st.lists(st.integers(0, 3), max_size=64),
    st.integers(0, 64),
)
def test_common_length_is_the_common_prefix(a, tail, keep):
    """The radix tree's prefix length (list comparisons, halving) against its definition."""
    b = a[:keep] + tail
    expected = 0
    while expected < min(len(a), len(b)) and a[expected] == b[expected]:
        expected += 1
    assert _common_length(a, b) == expected
    assert _common_length(b, a) == expected
