"""Attention metadata: where a flat batch of new tokens sits in the latent KV cache, and how
the step's sequences are grouped so that no query is padded.

A forward step runs T new tokens drawn from B sequences, flattened in sequence order. Each
sequence b contributes q_b new tokens at the end of its context of L_b tokens (its cached
prefix plus the new ones). The metadata is built once per step and shared by every layer.

Ragged, not padded: attention runs per *group*, and a group never pads a query.

* the decode group: every sequence with q_b = 1, attended together as [B_d, 1, L] (contexts
  padded to the longest, keys masked);
* one group per prefill chunk (q_b > 1): [1, q_b, L_b], alone, with no padding at all.

A mixed step (one 256-token prefill beside 15 decodes) thus costs its tokens' work, not
16 x 256 padded query rows.

    flat tokens:  [ a0 a1 a2 | b0 | c0 ]       T = 5 (a prefilling; b, c decoding)
    groups:       decode {rows [3, 4], kv_slots [[b slots .. L_b], [c slots .. L_c]] pad -> 0}
                  prefill a {rows 0:3, kv_slots [a slots .. L_a], mask [3, L_a] (plain
                             causal when a has no cached prefix)}

Invariants: `write_slots` are distinct; the new tokens' slots also appear in their group's
`kv_slots` at their positions, so each layer writes the new latents first and then reads its
context.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SequenceChunk:
    """One sequence's part of a step: `num_new` tokens appended at the end of its context.

    `kv_slots` ([L] int64) lists the cache slot of every position 0..L-1 of the sequence
    (L = context length after this step); the last `num_new` of them receive this step's latents.
    """

    kv_slots: torch.Tensor
    num_new: int


@dataclass(frozen=True)
class AttentionGroup:
    """Sequences attended together as one [batch_size, query_len, L] batch with no query
    padding: all decodes (query_len 1), or a single sequence's chunk.

    `rows` are the group's tokens in the step's flat layout, in [batch_size * query_len]
    order: a slice when they are contiguous, else an index tensor.
    """

    rows: slice | torch.Tensor
    batch_size: int
    query_len: int
    kv_slots: torch.Tensor  # [B, L] cache slots of each sequence's context (pad -> 0)
    mask: torch.Tensor | None  # [B, Q, L] bool, True = attend; None when nothing is masked
    causal: bool  # a single fresh sequence (Q == L): `mask` is plain causal (is_causal works)
    sum_query_len: int
    sum_query_times_context: int  # sum over b of q_b * L_b: attention score count per head
    sum_context: int  # sum over b of L_b: latents a non-absorbed path must expand


@dataclass(frozen=True)
class AttentionMetadata:
    """Tensors describing one step's attention (see the module docstring for the layout)."""

    positions: torch.Tensor  # [T] position of each new token in its sequence
    write_slots: torch.Tensor  # [T] cache slot receiving each new token's latent
    groups: tuple[AttentionGroup, ...]
    batch_size: int
    max_position: int
    sum_query_len: int  # T
    sum_query_times_context: int
    sum_context: int

    @staticmethod
    def build(chunks: list[SequenceChunk], device: torch.device | str = "cpu") -> AttentionMetadata:
        """Build the step's tensors from per-sequence slot tensors (Python work is O(B))."""
        q_lens = [c.num_new for c in chunks]
        ctx_lens = [int(c.kv_slots.shape[0]) for c in chunks]
        for b, (q, length) in enumerate(zip(q_lens, ctx_lens, strict=True)):
            if q < 1 or q > length:
                raise ValueError(f"sequence {b}: num_new={q} with context {length}")
        starts, offset = [], 0
        for q in q_lens:
            starts.append(offset)
            offset += q
        decodes = [b for b, q in enumerate(q_lens) if q == 1]
        groups = []
        if decodes:
            groups.append(_decode_group(chunks, decodes, starts, ctx_lens, offset, device))
        groups += [
            _prefill_group(chunks[b], starts[b], device) for b, q in enumerate(q_lens) if q > 1
        ]
        if len(chunks) == 1:
            (chunk,) = chunks
            write_slots = chunk.kv_slots[ctx_lens[0] - q_lens[0] :]
            positions = torch.arange(ctx_lens[0] - q_lens[0], ctx_lens[0])
        else:
            write_slots = torch.cat([c.kv_slots[-c.num_new :] for c in chunks])
            positions = torch.cat([torch.arange(l - q, l) for q, l in zip(q_lens, ctx_lens)])
        return AttentionMetadata(
            positions=positions.to(device),
            write_slots=write_slots.to(device=device, dtype=torch.long),
            groups=tuple(groups),
            batch_size=len(chunks),
            max_position=max(ctx_lens) - 1,
            sum_query_len=offset,
            sum_query_times_context=sum(q * l for q, l in zip(q_lens, ctx_lens, strict=True)),
            sum_context=sum(ctx_lens),
        )


def _decode_group(chunks, decodes, starts, ctx_lens, num_tokens, device) -> AttentionGroup:
    """Every one-token sequence of the step, as one [B_d, 1, L] batch."""
    lens = [ctx_lens[b] for b in decodes]
    max_l = max(lens)
    if len(decodes) == 1:
        kv_slots = chunks[decodes[0]].kv_slots[None]
    else:
        kv_slots = torch.zeros(len(decodes), max_l, dtype=torch.long)
        for i, b in enumerate(decodes):
            kv_slots[i, : lens[i]] = chunks[b].kv_slots
    mask = None
    if min(lens) != max_l:  # pad keys beyond a sequence's context are masked out
        mask = (torch.arange(max_l)[None, :] < torch.tensor(lens)[:, None])[:, None, :]
        mask = mask.to(device)
    rows = [starts[b] for b in decodes]
    if rows == list(range(rows[0], rows[0] + len(rows))):
        row_index: slice | torch.Tensor = slice(rows[0], rows[0] + len(rows))
    else:
        row_index = torch.tensor(rows, device=device)
    return AttentionGroup(
        rows=row_index,
        batch_size=len(decodes),
        query_len=1,
        kv_slots=kv_slots.to(device=device, dtype=torch.long),
        mask=mask,
        causal=False,
        sum_query_len=len(decodes),
        sum_query_times_context=sum(lens),
        sum_context=sum(lens),
    )


def _prefill_group(chunk: SequenceChunk, start: int, device) -> AttentionGroup:
    """One sequence's chunk of q > 1 tokens, alone: [1, q, L]."""
    q, length = chunk.num_new, int(chunk.kv_slots.shape[0])
    # query i sits at position L - q + i and sees keys 0 .. L - q + i
    mask = (torch.arange(length)[None, :] <= torch.arange(length - q, length)[:, None])[None]
    return AttentionGroup(
        rows=slice(start, start + q),
        batch_size=1,
        query_len=q,
        kv_slots=chunk.kv_slots[None].to(device=device, dtype=torch.long),
        mask=mask.to(device),
        causal=q == length,
        sum_query_len=q,
        sum_query_times_context=q * length,
        sum_context=length,
    )
