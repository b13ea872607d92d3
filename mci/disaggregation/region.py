"""Where an engine's latent KV sits in its registered memory, and the byte ranges a transfer
reads.

    kv_cache [num_layers, num_slots, latent]  (model.allocate_kv_cache: one contiguous tensor)
    row of (layer l, slot s) = base + l * layer_stride + s * row_bytes, row_bytes long

A transfer moves the rows of a sequence's positions, every layer, from the prefill side's
slots to the decode side's. The pool hands out slots in runs (descending within an
allocation), so pairs of (peer slot, local slot) are sorted and merged into runs consecutive
on both sides: one range per run and layer, not per token.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch


@dataclass(frozen=True)
class KVRegion:
    """An engine's KV tensor as peers address it."""

    session: str  # the transport's name for this engine's memory
    base: int
    layer_stride: int
    row_bytes: int
    num_layers: int
    num_slots: int

    @classmethod
    def of(cls, session: str, kv_cache: torch.Tensor) -> KVRegion:
        if not kv_cache.is_contiguous():
            raise ValueError("the KV cache must be one contiguous tensor to be transferred")
        layers, slots, latent = kv_cache.shape
        row = latent * kv_cache.element_size()
        return cls(session, kv_cache.data_ptr(), slots * row, row, layers, slots)

    def as_wire(self) -> dict:
        return asdict(self)

    @classmethod
    def from_wire(cls, data: dict) -> KVRegion:
        return cls(**{k: data[k] for k in cls.__dataclass_fields__})


def runs(peer_slots: list[int], local_slots: list[int]) -> list[tuple[int, int, int]]:
    """(peer start, local start, count) covering each pair once, consecutive on both sides."""
    merged: list[list[int]] = []
    for peer, local in sorted(zip(peer_slots, local_slots, strict=True)):
        last = merged[-1] if merged else None
        if last and last[0] + last[2] == peer and last[1] + last[2] == local:
            last[2] += 1
        else:
            merged.append([peer, local, 1])
    return [tuple(r) for r in merged]


def read_plan(
    local: KVRegion, local_slots: list[int], peer: KVRegion, peer_slots: list[int]
) -> tuple[list[int], list[int], list[int]]:
    """(local addresses, peer addresses, lengths): every layer's rows of peer slot i into
    local slot i. A layout that differs (layers, row size) or a slot out of range is a
    ValueError: such a read would land in the wrong place."""
    if (local.num_layers, local.row_bytes) != (peer.num_layers, peer.row_bytes):
        raise ValueError(
            f"KV layouts differ: {peer.num_layers} layers of {peer.row_bytes}-byte rows there, "
            f"{local.num_layers} of {local.row_bytes} here"
        )
    for slots, region in ((local_slots, local), (peer_slots, peer)):
        if slots and not (0 <= min(slots) and max(slots) < region.num_slots):
            raise ValueError("a slot outside the KV pool")
    local_addrs, peer_addrs, lengths = [], [], []
    spans = runs(peer_slots, local_slots)
    for layer in range(local.num_layers):
        local_layer = local.base + layer * local.layer_stride
        peer_layer = peer.base + layer * peer.layer_stride
        for peer_start, local_start, count in spans:
            local_addrs.append(local_layer + local_start * local.row_bytes)
            peer_addrs.append(peer_layer + peer_start * peer.row_bytes)
            lengths.append(count * local.row_bytes)
    return local_addrs, peer_addrs, lengths
