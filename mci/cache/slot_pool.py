"""A pool of KV cache token slots (page size one token).

Every token whose latent is cached occupies one slot: a row index into the latent cache
tensor. The pool only hands out and takes back indices; who owns a used slot (a running
request, or the radix tree) is tracked by the owners.

    free_slots: [ s7 s2 s9 s0 ... | (stale) ]    a stack; the first `num_free` entries are free
                  ^ alloc takes from the top (the end), free pushes back

Invariant: every slot is either in the free stack exactly once or owned by exactly one owner;
`check_integrity` proves it given the owners' slots.
"""

from __future__ import annotations

import torch


class OutOfSlotsError(RuntimeError):
    """Raised by `alloc` when fewer slots are free than asked for (callers check first)."""


class SlotPool:
    """Free-list of `num_slots` token slots; alloc and free are O(tokens)."""

    def __init__(self, num_slots: int, device: torch.device | str = "cpu"):
        if num_slots < 1:
            raise ValueError("a slot pool needs at least one slot")
        self.num_slots = num_slots
        self.device = device
        self._free = torch.arange(num_slots - 1, -1, -1, dtype=torch.long, device=device)
        self.num_free = num_slots

    def alloc(self, n: int) -> torch.Tensor:
        """Take `n` free slots; returns a new [n] int64 tensor."""
        slots = self._top(n).clone()
        self.num_free -= n
        return slots

    def alloc_into(self, out: torch.Tensor) -> None:
        """Take `len(out)` free slots, written into `out` (no tensor made: a decode step takes
        one slot a request, and a copy straight into its slot buffer is one torch op less).
        Nothing is taken if the copy fails."""
        n = out.shape[0]
        out.copy_(self._top(n))
        self.num_free -= n

    def _top(self, n: int) -> torch.Tensor:
        """The top `n` of the free stack, not popped (a view)."""
        if n > self.num_free:
            raise OutOfSlotsError(f"asked for {n} slots, {self.num_free} free")
        return self._free[self.num_free - n : self.num_free]

    def free(self, slots: torch.Tensor) -> None:
        """Return slots to the pool. The caller must own them (no double free; see integrity)."""
        n = int(slots.numel())
        if n == 0:
            return
        if self.num_free + n > self.num_slots:
            raise RuntimeError("slot pool overflow: a slot was freed twice")
        self._free[self.num_free : self.num_free + n] = slots.reshape(-1)
        self.num_free += n

    def check_integrity(self, owned: list[torch.Tensor]) -> None:
        """Assert free slots + `owned` slots are each of 0..num_slots-1 exactly once."""
        parts = [self._free[: self.num_free]] + [o.reshape(-1) for o in owned]
        everything = torch.cat(parts) if parts else torch.empty(0, dtype=torch.long)
        counts = torch.bincount(everything, minlength=self.num_slots)
        if (
            everything.numel() != self.num_slots
            or counts.numel() != self.num_slots
            or (counts != 1).any()
        ):
            dup = (counts > 1).nonzero().flatten()[:5].tolist()
            lost = (counts == 0).nonzero().flatten()[:5].tolist()
            raise AssertionError(
                f"slot pool integrity violated: {everything.numel()} accounted for "
                f"{self.num_slots}; duplicated {dup}, lost {lost}"
            )
