"""The lower tiers of the prefix cache: host memory (L2) and a persistent store (L3) under the
radix tree (L1, the KV pool), in the manner of SGLang's HiCache.

The tree stays the index of L1. Below it the tiers hold whole pages (`page_tokens` positions
from a multiple of `page_tokens`) named by `PageKeys`: a page's key names its whole prefix and
the model that computed it, so any process with the same identity may use it.

    admission:  tree match ──> m tokens in L1 ──> pages m//P.. found in L2, else in L3
                                                  └─ loaded into fresh L1 slots, inserted
                                                     into the tree (a hit, not a prefill)
    caching:    write_through: a prefix the tree takes is copied to L2 and queued for L3
                write_back:    copied to L2 when L1 evicts it, to L3 when L2 evicts it
    eviction:   L1 evicting a leaf demotes its full pages to L2 (never a drop while L2 has room)

Invariants:
* a page is loaded only by key, so only pages of the same token prefix and identity are used;
  L3 serves a page only after its checksum and identity are verified (mci/cache/file_store.py),
  and a page that fails is counted, deleted and recomputed.
* loads write only slots the caller allocated for them; the tree then owns those slots.
* writes to L3 run on one background thread with a bounded queue: the engine never waits for
  the disk, a full queue drops the write (counted), a failing disk disables L3 (serving goes on).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import torch

from mci.cache.file_store import FileStore
from mci.cache.host_store import HostStore
from mci.cache.page_keys import PageKeys
from mci.cache.tier_stats import TierCounters

log = logging.getLogger("mci")

TIERS = ("host", "storage")
WRITE_QUEUE_BYTES = 256 << 20  # pages waiting for the disk at most (copies in host memory)
CLOSE_TIMEOUT_S = 30.0  # a clean shutdown waits this long for the disk, no longer
KNOWN_STORED = 1 << 16  # keys remembered as written to L3 (not asked of the disk again)


@dataclass(frozen=True)
class Loaded:
    """What a load brought into L1: its slots and tokens per tier."""

    slots: torch.Tensor
    tokens: dict[str, int]


class HierarchicalCache:
    """L2 and L3 for one KV pool (`kv_cache`: [rows, slots, latent], indexed by slot)."""

    def __init__(
        self,
        kv_cache: torch.Tensor,
        keys: PageKeys,
        host: HostStore,
        store: FileStore | None,
        write_back: bool,
    ):
        self.kv_cache = kv_cache
        self.keys = keys
        self.page_tokens = keys.page_tokens
        self.host = host
        self.store = store
        self.write_back = write_back
        self.page_shape = (kv_cache.shape[0], self.page_tokens, kv_cache.shape[2])
        self.tiers = {tier: TierCounters() for tier in TIERS}
        self.demotions = 0  # pages L1 evicted into L2
        self.host_evictions = 0
        self.queue_full = 0  # L3 writes dropped: the disk fell behind
        self.lookups = 0
        self._known: OrderedDict[str, None] = OrderedDict()  # keys written to (or read from) L3
        self._writes: queue.Queue = queue.Queue(max(1, WRITE_QUEUE_BYTES // host.page_bytes))
        self._stats_lock = threading.Lock()  # the writer thread's counters
        self._writer = None
        if store is not None:
            self._writer = threading.Thread(
                target=self._write_loop, name="mci-hicache-writer", daemon=True
            )
            self._writer.start()

    # ---- lookup and load ----------------------------------------------------------------------
    def pages_to_load(self, token_ids: list[int], start: int) -> list[tuple[str, str]]:
        """(key, tier) of the pages after the first `start` cached tokens that a lower tier
        holds, in order, up to the first missing one: the page holding position `start`
        first (its positions before `start` are in L1 already)."""
        p = self.page_tokens
        first, last = start // p, len(token_ids) // p
        if first >= last:
            return []
        self.lookups += 1
        found = []
        for key in self.keys.keys(token_ids, last)[first:]:
            if self.host.get(key) is not None:  # now recently used: the room made next keeps it
                found.append((key, "host"))
            elif self.store is not None and self.store.contains(key):
                found.append((key, "storage"))
            else:
                break
        return found

    def load(self, pages: list[tuple[str, str]], start: int, slots: torch.Tensor) -> Loaded:
        """Copy the pages' positions from `start` on into `slots` (one per position, allocated
        by the caller for pages_to_load's answer). Stops at a page the tier no longer has or
        that fails its checks: `Loaded.slots` are the slots filled, the caller frees the rest."""
        p, done = self.page_tokens, 0
        tokens = dict.fromkeys(TIERS, 0)
        for key, tier in pages:
            begin = time.perf_counter()
            offset = (start + done) % p
            page = self.host.get(key) if tier == "host" else None
            if page is None and self.store is not None:  # not in L2 (any more): try L3
                page, tier = self._read(key), "storage"
            if page is None:
                break
            n = p - offset
            dst = slots[done : done + n].to(self.kv_cache.device)
            self.kv_cache.index_copy_(1, dst, page[:, offset:].to(self.kv_cache.device))
            counters = self.tiers[tier]
            counters.hit_pages += 1
            counters.hit_tokens += n
            counters.bytes_loaded += n * self.host.page_bytes // p
            counters.load_s.observe(time.perf_counter() - begin)
            tokens[tier] += n
            done += n
        return Loaded(slots[:done], tokens)

    def _read(self, key: str) -> torch.Tensor | None:
        """An L3 page, verified, and kept in L2 as well (the next hit is from memory)."""
        page = self.store.get(key, self.kv_cache.dtype, self.page_shape)
        if page is not None:
            self._remember(key)
            self._put_host(key, page)
        return page

    # ---- writes ---------------------------------------------------------------------------
    def on_cached(self, token_ids: list[int], slots: torch.Tensor) -> None:
        """The tree took `token_ids` (their L1 `slots`): write-through copies their full pages
        down now (write-back waits for the eviction)."""
        if self.write_back:
            return
        num_pages = len(token_ids) // self.page_tokens
        store = self.store
        for i, key in enumerate(self.keys.keys(token_ids, num_pages)):
            in_host = key in self.host
            in_store = store is None or not store.enabled or key in self._known
            if in_host and in_store:
                continue
            page = self._page_of(slots, i)
            if not in_host:
                self._put_host(key, page)
            if not in_store:
                self._queue_store(key, page)

    def on_evicted(self, token_ids: list[int], slots: torch.Tensor, leaf_start: int) -> None:
        """L1 evicts the tree's positions from `leaf_start` of the path `token_ids` (`slots`
        still valid): the full pages ending in them go to L2 (a demotion, not a drop)."""
        p = self.page_tokens
        first, last = leaf_start // p, len(token_ids) // p
        if first >= last:
            return
        for i, key in enumerate(self.keys.keys(token_ids, last)[first:], start=first):
            if key not in self.host:
                self._put_host(key, self._page_of(slots, i))
                self.demotions += 1

    def _page_of(self, slots: torch.Tensor, i: int) -> torch.Tensor:
        p = self.page_tokens
        rows = slots[i * p : (i + 1) * p].to(self.kv_cache.device)
        return self.kv_cache.index_select(1, rows).cpu()

    def _put_host(self, key: str, page: torch.Tensor) -> None:
        begin = time.perf_counter()
        keep = self.write_back and self.store is not None
        for old, old_page in self.host.put(key, page, keep_evicted=keep):
            self.host_evictions += 1
            if old_page is not None and old not in self._known:
                self._queue_store(old, old_page)
        counters = self.tiers["host"]
        counters.stored_pages += 1
        counters.bytes_stored += self.host.page_bytes
        counters.store_s.observe(time.perf_counter() - begin)

    def _queue_store(self, key: str, page: torch.Tensor) -> None:
        if self.store is None or not self.store.enabled:
            return
        try:
            self._writes.put_nowait((key, page))
        except queue.Full:
            self.queue_full += 1
            return
        self._remember(key)

    def _remember(self, key: str) -> None:
        self._known[key] = None
        self._known.move_to_end(key)
        if len(self._known) > KNOWN_STORED:
            self._known.popitem(last=False)

    def _write_loop(self) -> None:
        while True:
            item = self._writes.get()
            try:
                if item is None:
                    return
                key, page = item
                begin = time.perf_counter()
                if self.store.put(key, page):
                    with self._stats_lock:
                        counters = self.tiers["storage"]
                        counters.stored_pages += 1
                        counters.bytes_stored += self.host.page_bytes
                        counters.store_s.observe(time.perf_counter() - begin)
            except Exception:  # never let one page end the writer: the store logs disk faults
                log.exception("hierarchical cache: a page write failed")
            finally:
                self._writes.task_done()

    def flush(self, timeout_s: float = CLOSE_TIMEOUT_S) -> bool:
        """Wait until every queued L3 write is done, at most `timeout_s`; whether they are."""
        deadline = time.monotonic() + timeout_s
        while self._writer is not None and self._writes.unfinished_tasks:
            if time.monotonic() > deadline or not self._writer.is_alive():
                return False
            time.sleep(0.01)
        return True

    def close(self) -> None:
        """Finish the queued writes (a bounded wait: a stuck disk must not hold up the
        engine's exit; what is left is lost, as in a crash) and stop the writer."""
        if self._writer is None or not self._writer.is_alive():
            return
        try:
            self._writes.put(None, timeout=CLOSE_TIMEOUT_S)
        except queue.Full:
            left = self._writes.qsize()
            log.warning("hierarchical cache: the disk fell behind; %d page writes lost", left)
            return
        self._writer.join(timeout=CLOSE_TIMEOUT_S)

    # ---- inspection -----------------------------------------------------------------------
    def stats(self) -> dict:
        with self._stats_lock:
            tiers = {tier: c.as_dict() for tier, c in self.tiers.items()}
        tiers["host"].update(
            pages=len(self.host),
            capacity_pages=self.host.num_pages,
            used_bytes=len(self.host) * self.host.page_bytes,
            capacity_bytes=self.host.num_pages * self.host.page_bytes,
            evictions=self.host_evictions,
        )
        store = self.store
        if store is not None:
            s = store.stats
            tiers["storage"].update(
                enabled=store.enabled,
                disabled_reason=store.disabled_reason,
                used_bytes=s.used_bytes,
                capacity_bytes=store.max_bytes,
                evictions=s.evictions,
                corrupt=s.corrupt,
                write_failures=s.write_failures,
                queued=self._writes.qsize(),
                dropped_writes=self.queue_full,
            )
        else:
            tiers.pop("storage")
        return {
            "identity": self.keys.identity,
            "page_tokens": self.page_tokens,
            "write_policy": "write_back" if self.write_back else "write_through",
            "lookups": self.lookups,
            "demotions": self.demotions,
            "tiers": tiers,
        }

    def check_integrity(self) -> None:
        self.host.check_integrity()
