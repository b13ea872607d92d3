"""The host-memory tier (L2): KV pages in one preallocated buffer, least recently used evicted.

    buffer [num_pages, rows, page_tokens, latent]     index: key -> page row (LRU order)
           row 0 │ row 1 │ ... │ row n-1              free: rows no key holds

Pinned when the KV pool is on a GPU (copies to and from it are then asynchronous DMA); on the
CPU a separate budget of ordinary memory. Invariant: each buffer row is free or held by
exactly one key; `get` returns a view that stays valid until the next `put` (callers copy
out of it at once).
"""

from __future__ import annotations

from collections import OrderedDict

import torch


class HostStore:
    """`num_pages` pages of shape `page_shape`; `put` returns the pages it evicted."""

    def __init__(self, num_pages: int, page_shape: tuple[int, ...], dtype, pin: bool = False):
        if num_pages < 1:
            raise ValueError("the host tier needs room for at least one page")
        self.num_pages = num_pages
        self.page_bytes = torch.Size(page_shape).numel() * dtype.itemsize
        self.buffer = torch.empty((num_pages, *page_shape), dtype=dtype, pin_memory=pin)
        self._index: OrderedDict[str, int] = OrderedDict()
        self._free = list(range(num_pages - 1, -1, -1))

    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, key: str) -> bool:
        return key in self._index

    def get(self, key: str) -> torch.Tensor | None:
        """The page (a view into the buffer), now the most recently used; None if absent."""
        row = self._index.get(key)
        if row is None:
            return None
        self._index.move_to_end(key)
        return self.buffer[row]

    def put(
        self, key: str, page: torch.Tensor, keep_evicted: bool
    ) -> list[tuple[str, torch.Tensor]]:
        """Store a copy of `page` under `key` (already present: only refreshed). Returns the
        pages evicted to make room, copied out when `keep_evicted` (write-back sends them
        down a tier), else with their keys only."""
        if key in self._index:
            self._index.move_to_end(key)
            return []
        evicted = []
        if not self._free:
            old, row = self._index.popitem(last=False)
            evicted.append((old, self.buffer[row].clone() if keep_evicted else None))
            self._free.append(row)
        row = self._free.pop()
        self.buffer[row].copy_(page)
        self._index[key] = row
        return evicted

    def check_integrity(self) -> None:
        """AssertionError unless every row is free or one key's, exactly once."""
        rows = sorted([*self._index.values(), *self._free])
        if rows != list(range(self.num_pages)):
            raise AssertionError(
                f"host tier: rows accounted {len(rows)} of {self.num_pages}, duplicated or lost"
            )
