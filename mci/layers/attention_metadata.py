"""Attention metadata: where a flat batch of new tokens sits in the latent KV cache.

A forward step runs T new tokens drawn from B sequences, flattened in sequence order. Each
sequence b contributes q_b new tokens at the end of its context of L_b tokens (its cached
prefix plus the new ones). The metadata is built once per step and shared by every layer.

    flat tokens:  [ a0 a1 a2 | b0 | c0 c1 ]                T = 6 (a prefilling, b, c decoding)
    padded_pos:   [ 0  1  2  | 3  | 6  7  ]                row of each token in [B*Q] (Q = 3)
    kv_slots:     [[a slots .. L_a], [b slots .. L_b], [c slots .. L_c]]   [B, L], pad -> 0
    mask[b, i, j] = j <= position of query i (and j < L_b)                [B, Q, L]

Invariants: `write_slots` are distinct; the new tokens' slots also appear in `kv_slots` at
their positions, so each layer writes the new latents first and then reads its context.
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
class AttentionMetadata:
    """Tensors describing one step's attention (see the module docstring for the layout)."""

    positions: torch.Tensor  # [T] position of each new token in its sequence
    write_slots: torch.Tensor  # [T] cache slot receiving each new token's latent
    padded_pos: torch.Tensor  # [T] row of each token in the padded [B*Q] query layout
    kv_slots: torch.Tensor  # [B, L] cache slots of each sequence's context (pad -> 0)
    mask: torch.Tensor | None  # [B, Q, L] bool, True = attend; None when nothing is masked
    batch_size: int
    max_query_len: int
    max_position: int
    sum_query_len: int  # T
    sum_query_times_context: int  # sum over b of q_b * L_b: attention score count per head
    sum_context: int  # sum over b of L_b: latents a non-absorbed path must expand

    @staticmethod
    def build(chunks: list[SequenceChunk], device: torch.device | str = "cpu") -> AttentionMetadata:
        """Build the step's tensors from per-sequence slot tensors (Python work is O(B))."""
        batch = len(chunks)
        q_lens = [c.num_new for c in chunks]
        ctx_lens = [int(c.kv_slots.shape[0]) for c in chunks]
        max_q, max_l = max(q_lens), max(ctx_lens)
        for b, (q, length) in enumerate(zip(q_lens, ctx_lens, strict=True)):
            if q < 1 or q > length:
                raise ValueError(f"sequence {b}: num_new={q} with context {length}")
        if batch == 1:
            (chunk,) = chunks
            kv_slots = chunk.kv_slots[None]
            write_slots = chunk.kv_slots[max_l - max_q :]
            positions = torch.arange(max_l - max_q, max_l)
            padded_pos = torch.arange(max_q)
        else:
            kv_slots = torch.zeros(batch, max_l, dtype=torch.long)
            for b, c in enumerate(chunks):
                kv_slots[b, : ctx_lens[b]] = c.kv_slots
            write_slots = torch.cat([c.kv_slots[-c.num_new :] for c in chunks])
            positions = torch.cat([torch.arange(l - q, l) for q, l in zip(q_lens, ctx_lens)])
            padded_pos = torch.cat(
                [torch.arange(b * max_q, b * max_q + q) for b, q in enumerate(q_lens)]
            )
        mask = None
        if max_q > 1 or min(ctx_lens) != max_l:
            q_lens_t, ctx_t = torch.tensor(q_lens), torch.tensor(ctx_lens)
            # query i of sequence b sits at position ctx_b - q_b + i; pad queries see key 0 only.
            idx = torch.arange(max_q)[None, :]
            q_pos = torch.where(idx < q_lens_t[:, None], (ctx_t - q_lens_t)[:, None] + idx, 0)
            mask = (torch.arange(max_l)[None, None, :] <= q_pos[:, :, None]).to(device)  # [B, Q, L]
        return AttentionMetadata(
            positions=positions.to(device),
            write_slots=write_slots.to(device=device, dtype=torch.long),
            padded_pos=padded_pos.to(device),
            kv_slots=kv_slots.to(device=device, dtype=torch.long),
            mask=mask,
            batch_size=batch,
            max_query_len=max_q,
            max_position=max_l - 1,
            sum_query_len=sum(q_lens),
            sum_query_times_context=sum(q * l for q, l in zip(q_lens, ctx_lens, strict=True)),
            sum_context=sum(ctx_lens),
        )
