"""Request-level KV memory: prefix matching, slot allocation with eviction, caching, release.

The one place that moves slots between the pool, the radix tree and requests. Invariant
(checked by `check_integrity`): each slot is free, owned by the tree, or owned by exactly one
request (`request.own_slots`); a request holds a lock on `last_node`, which keeps its first
`cached_len` slots (the tree's) alive.

Ownership of a request's KV fields (`slots`, `num_slots`, `cached_len`, `last_node`, and the
`num_computed_tokens` that `match` sets) lives here: `release` resets everything `match` and
`allocate` set, so a released request is exactly as it was before admission, less its outputs.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from mci.cache.hierarchy import HierarchicalCache
from mci.cache.radix_cache import RadixCache, RadixNode
from mci.cache.slot_pool import SlotPool
from mci.core.request import Request


@dataclass(frozen=True)
class KVHold:
    """A request's KV kept after the request ended, for a reader in another engine (the
    prefill side of a disaggregated pair): the slots of positions [0, len(slots)). The tree's
    slots, alive while `node` stays locked by the hold; without the radix cache (`node` None)
    the hold owns the slots itself."""

    hold_id: int
    slots: torch.Tensor  # [num_tokens] slot of each position
    node: object = None


class KVCacheManager:
    """Slots for requests, with an optional radix prefix cache (None = disabled).

    `match_margin`: positions a prefix match leaves at its end, to be computed again by the
    request (MTP drafting needs the main model's state at the position before its first
    computed one; see mci/speculative/mtp.py)."""

    def __init__(self, pool: SlotPool, radix: RadixCache | None, match_margin: int = 0):
        self.pool = pool
        self.radix = radix
        self.match_margin = match_margin
        self.tiers: HierarchicalCache | None = None  # L2/L3 under the tree (attach_tiers)
        # disaggregation: KV kept for another engine's read (prefill side), and slots a
        # cancelled read may still write into (decode side), each until it is safe to let go
        self.holds: dict[int, KVHold] = {}
        self.quarantined: dict[str, torch.Tensor] = {}
        self._hold_ids = itertools.count()

    def attach_tiers(self, tiers: HierarchicalCache) -> None:
        """Put host memory and a store under the tree: evictions demote, matches load."""
        if self.radix is None:
            raise ValueError("the lower cache tiers need the radix cache")
        self.tiers = tiers
        self.radix.on_evict = self._demote

    def _demote(self, leaf: RadixNode) -> None:
        tokens, slots = self.radix.path_of(leaf)
        self.tiers.on_evicted(tokens, slots, len(tokens) - len(leaf.key))

    @property
    def available(self) -> int:
        """Slots obtainable now: free plus evictable from the tree."""
        return self.pool.num_free + (self.radix.evictable_tokens if self.radix else 0)

    def prefix_match_length(self, request: Request) -> int:
        """Cached prefix length for admission ordering (no locking)."""
        if self.radix is None:
            return 0
        matched = len(self.radix.match_prefix(self._matchable(request))[0])
        return max(matched - self.match_margin, 0)

    @staticmethod
    def _matchable(request: Request) -> list[int]:
        # At least one token must be computed to produce logits, so never match all of them.
        # A request scoring its prompt needs the logits of every prompt position: no match.
        if request.scores_prompt:
            return []
        return request.token_ids[: request.num_tokens - 1]

    def match(self, request: Request) -> None:
        """Attach the longest cached prefix to a request that holds no slots (admission)."""
        if request.num_slots or request.last_node is not None:
            raise RuntimeError(f"{request.request_id} already holds KV slots")
        if self.radix is None:
            return
        tokens = self._matchable(request)
        slots, node = self.radix.match_prefix(tokens)
        if self.tiers is not None:
            slots, node = self._load_from_tiers(request, tokens, slots, node)
        n = max(len(slots) - self.match_margin, 0)  # the lock on `node` covers these too
        self.radix.inc_lock(node)
        request.slots[:n] = slots[:n]
        request.matched_next_slot = int(slots[n]) if 0 < n < len(slots) else None
        request.last_node = node
        request.cached_len = request.num_slots = request.num_computed_tokens = n

    def _load_from_tiers(
        self, request: Request, tokens: list[int], slots: torch.Tensor, node: RadixNode
    ) -> tuple[torch.Tensor, RadixNode]:
        """Extend the tree's match with the pages L2/L3 hold: fresh slots (evicting unlocked
        cache, never this match), filled from the tiers, inserted into the tree. Returns the
        new match; `request.tier_tokens` adds the tokens each tier gave (kept across an
        admission that is undone, so the first admission reports where they came from)."""
        start = len(slots)
        pages = self.tiers.pages_to_load(tokens, start)
        if not pages:
            return slots, node
        want = len(pages) * self.tiers.page_tokens - start % self.tiers.page_tokens
        self.radix.inc_lock(node)  # the eviction below must not take the match itself
        try:
            if want > self.pool.num_free + self.radix.evictable_tokens:
                return slots, node  # no room now (and no eviction for nothing): computed
            if want > self.pool.num_free:
                self.radix.evict(want - self.pool.num_free)
        finally:
            self.radix.dec_lock(node)
        if want > self.pool.num_free:
            return slots, node
        fresh = self.pool.alloc(want)
        try:
            loaded = self.tiers.load(pages, start, fresh)
        except BaseException:
            self.pool.free(fresh)
            raise
        self.pool.free(fresh[len(loaded.slots) :])
        if not len(loaded.slots):
            return slots, node
        end = start + len(loaded.slots)
        present = self.radix.insert(tokens[:end], torch.cat([slots, loaded.slots]))
        if present != start:
            raise AssertionError(f"radix cache: {present} tokens present, matched {start}")
        before = request.tier_tokens or {}
        request.tier_tokens = {t: before.get(t, 0) + n for t, n in loaded.tokens.items()}
        return self.radix.match_prefix(tokens)

    def cached_tokens_details(self, request: Request) -> dict | None:
        """The request's cached tokens by tier ("device": found in L1; "host", "storage":
        loaded from L2, L3); None without the lower tiers. The positions the match left to
        compute again (`match_margin`) are taken from the lowest tier first."""
        if self.tiers is None:
            return None
        loaded = request.tier_tokens or {}
        storage, host = loaded.get("storage", 0), loaded.get("host", 0)
        excess = storage + host - request.cached_len
        if excess > 0:
            cut = min(excess, storage)
            storage, host = storage - cut, max(host - (excess - cut), 0)
        return {"device": request.cached_len - host - storage, "host": host, "storage": storage}

    def allocate(self, request: Request, n: int) -> bool:
        """Slots for the request's next `n` positions, evicting unlocked cache if needed."""
        short = n - self.pool.num_free
        if short > 0 and self.radix is not None:
            self.radix.evict(short)
        if n > self.pool.num_free:
            return False
        start = request.num_slots
        room = request.slots[start : start + n]
        if room.shape[0] != n:  # past the request's slot buffer: nothing is taken
            raise RuntimeError(f"{request.request_id}: {n} slots past its slot buffer")
        self.pool.alloc_into(room)
        request.num_slots += n
        return True

    def drop_unverified(self, request: Request) -> None:
        """Free the slots of positions past `num_computed_tokens` (rejected speculative
        drafts: their latents were computed, then found to follow wrong tokens)."""
        keep = request.num_computed_tokens
        if keep < request.cached_len:
            raise RuntimeError(f"{request.request_id}: cannot drop slots the tree owns")
        self.pool.free(request.slots[keep : request.num_slots])
        request.num_slots = keep

    def cache_prefix(self, request: Request) -> None:
        """Insert the request's computed tokens into the tree; the tree takes their slots.

        Slots the request computed for tokens the tree already had are freed, and the request
        switches to the tree's copies; its lock moves to the deeper node.
        """
        if self.radix is None:
            return
        n = request.num_computed_tokens
        tokens = request.token_ids[:n]
        present = self.radix.insert(tokens, request.slots[:n])
        self.pool.free(request.slots[request.cached_len : present])
        slots, node = self.radix.match_prefix(tokens)
        if len(slots) != n:
            raise AssertionError("radix cache lost a prefix it just inserted")
        if self.tiers is not None:
            self.tiers.on_cached(tokens, slots)
        request.slots[:n] = slots
        self.radix.inc_lock(node)
        if request.last_node is not None:
            self.radix.dec_lock(request.last_node)
        request.last_node = node
        request.cached_len = n

    def release(self, request: Request) -> None:
        """Give back everything the request holds (finish, abort or preemption) and reset its
        KV accounting: it computes from position 0 again if it is ever rescheduled.

        Computed tokens stay in the tree (unlocked, evictable) when the cache is on.
        """
        if request.num_computed_tokens > request.cached_len:
            self.cache_prefix(request)
        self.pool.free(request.slots[request.cached_len : request.num_slots])
        if self.radix is not None and request.last_node is not None:
            self.radix.dec_lock(request.last_node)
        request.last_node = None
        request.cached_len = request.num_slots = request.num_computed_tokens = 0
        request.mtp_pending = request.matched_next_slot = None
        if request.first_scheduled_time is not None:  # admitted: its report is taken
            request.tier_tokens = None

    # ---- disaggregation ------------------------------------------------------------------------
    def hold(self, request: Request) -> KVHold:
        """Keep the KV of the request's computed positions after it ends (call before
        `release`): in the tree under a lock of the hold's own, or, without the radix cache,
        as slots the hold takes over from the request. Given back by `unhold`."""
        n = request.num_computed_tokens
        if self.radix is not None:
            if n > request.cached_len:
                self.cache_prefix(request)
            self.radix.inc_lock(request.last_node)
            hold = KVHold(next(self._hold_ids), request.slots[:n].clone(), request.last_node)
        else:
            hold = KVHold(next(self._hold_ids), request.slots[:n].clone())
            self.pool.free(request.slots[n : request.num_slots])
            request.num_slots = request.num_computed_tokens = 0  # its slots are the hold's
        self.holds[hold.hold_id] = hold
        return hold

    def unhold(self, hold_id: int) -> None:
        """The reader is done (or gone): the held KV becomes ordinary cache again."""
        hold = self.holds.pop(hold_id, None)
        if hold is None:
            return
        if hold.node is not None:
            self.radix.dec_lock(hold.node)
        else:
            self.pool.free(hold.slots)

    def quarantine(self, request: Request) -> None:
        """The request's own slots may still be written by a transfer that was cancelled in
        flight: keep them out of the pool (call before `release`) until `end_quarantine`."""
        own = request.own_slots.clone()
        request.num_slots = request.cached_len
        if request.num_computed_tokens > request.cached_len:
            request.num_computed_tokens = request.cached_len
        if len(own):
            self.quarantined[request.request_id] = own

    def end_quarantine(self, request_id: str) -> None:
        """Nothing can write into the request's quarantined slots any more: free them."""
        slots = self.quarantined.pop(request_id, None)
        if slots is not None:
            self.pool.free(slots)

    def check_integrity(self, requests: Iterable[Request]) -> None:
        """Assert every slot is free, the tree's, exactly one request's, a hold's or
        quarantined."""
        owned = [r.own_slots for r in requests if r.num_slots > r.cached_len]
        owned += [h.slots for h in self.holds.values() if h.node is None]
        owned += list(self.quarantined.values())
        if self.radix is not None:
            self.radix.check_invariants()
            owned += self.radix.owned_slots()
        if self.tiers is not None:
            self.tiers.check_integrity()
        self.pool.check_integrity(owned)
