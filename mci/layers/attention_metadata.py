"""Attention metadata: where a flat batch of new tokens sits in the latent KV cache, and how
the step's sequences are grouped so that no query is padded.

A forward step runs T new tokens drawn from B sequences, flattened in sequence order. Each
sequence b contributes q_b new tokens at the end of its context of L_b tokens (its cached
prefix plus the new ones). The metadata is built once per step and shared by every layer.

Ragged, not padded: attention runs per *group*, and a group never pads a query.

* the decode group: every sequence with q_b = 1, attended together as [B_d, 1, L] (contexts
  padded to the longest, keys masked). With `AttentionLayout.row_query_max` = m > 1 the
  sequences with q_b <= m join it too, one item per query row: row j of sequence b attends
  to its first L_b - q_b + 1 + j keys (a speculative verification's k + 1 rows, read in place
  by the CPU decode kernel instead of one gathered, masked call per sequence);
* prefill chunks (q_b > 1, or > m) grouped by shape: the chunks with the same (q, L) attend
  together as [B_s, q, L] with no padding at all (a burst of equal prompts is one batched
  call); a chunk of its own shape attends alone.

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
import torch.nn.functional as F


@dataclass(frozen=True)
class AttentionLayout:
    """How a step's sequences are laid out for attention (chosen by the model, see
    `DeepseekV3ForCausalLM.attention_layout`).

    `key_multiple` > 1 pads every group's key length up to a multiple of it (the pad keys
    masked out), so that a query's attention is computed over the same key blocks whatever
    the other sequences of its group, the chunk it came in, or the step (see
    `mci.layers.attention.ATTENTION_KEY_MULTIPLE`). Sequences with at most `row_query_max`
    new tokens attend in the decode group, one item per query row. A prefill group whose
    sequences share their first `cascade_min_prefix` or more cache slots (a prefix-cache hit
    of several requests) records that shared prefix, which attention then reads once for
    them all (0: never).
    """

    key_multiple: int = 1
    row_query_max: int = 1
    cascade_min_prefix: int = 0


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
    padding: all decodes (query_len 1; a sequence with several query rows there is one item
    per row), or prefill chunks of one shape.

    `rows` are the group's tokens in the step's flat layout, in [batch_size * query_len]
    order: a slice when they are contiguous, else an index tensor.
    """

    rows: slice | torch.Tensor
    batch_size: int
    query_len: int
    kv_slots: torch.Tensor  # [B, L] cache slots of each sequence's context (pad -> 0)
    mask: torch.Tensor | None  # [B, Q, L] bool, True = attend; None when nothing is masked
    # [B] int64 context length of each item (the decode group: kernels that read the cache
    # through `kv_slots` stop there instead of masking); None for prefill groups
    lengths: torch.Tensor | None
    causal: bool  # a single fresh sequence (Q == L): `mask` is plain causal (is_causal works)
    # [1, Q] int64, prefill groups: query row r sees keys 0 .. key_limits[0, r] - 1 (what
    # `mask` says, as the CPU prefill kernel takes it); None for the decode group
    key_limits: torch.Tensor | None
    # leading context positions whose slots every sequence of the group shares (at least
    # `AttentionLayout.cascade_min_prefix` of them, else 0): all the group's queries see them
    shared_prefix: int
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
    def build(
        chunks: list[SequenceChunk],
        device: torch.device | str = "cpu",
        layout: AttentionLayout = AttentionLayout(),
    ) -> AttentionMetadata:
        """Build the step's tensors from per-sequence slot tensors (Python work is O(B), and
        O(rows) for the decode group's multi-row sequences)."""
        q_lens = [c.num_new for c in chunks]
        ctx_lens = [int(c.kv_slots.shape[0]) for c in chunks]
        for b, (q, length) in enumerate(zip(q_lens, ctx_lens, strict=True)):
            if q < 1 or q > length:
                raise ValueError(f"sequence {b}: num_new={q} with context {length}")
        starts, offset = [], 0
        for q in q_lens:
            starts.append(offset)
            offset += q
        row_max = max(1, layout.row_query_max)
        decodes = [b for b, q in enumerate(q_lens) if q <= row_max]
        groups = []
        if decodes:
            groups.append(
                _decode_group(chunks, decodes, starts, ctx_lens, device, layout.key_multiple)
            )
        shapes: dict[tuple[int, int], list[int]] = {}
        for b, q in enumerate(q_lens):
            if q > row_max:
                shapes.setdefault((q, ctx_lens[b]), []).append(b)
        groups += [
            _prefill_group([chunks[b] for b in seqs], [starts[b] for b in seqs], device, layout)
            for seqs in shapes.values()
        ]
        if len(chunks) == 1:
            (chunk,) = chunks
            write_slots = chunk.kv_slots[ctx_lens[0] - q_lens[0] :]
            positions = torch.arange(ctx_lens[0] - q_lens[0], ctx_lens[0])
        elif offset == len(chunks):  # one new token each: all of them in the decode group
            (group,) = groups
            positions = group.lengths - 1  # in the decode group's row order, the flat order
            write_slots = group.kv_slots.gather(1, positions[:, None]).view(-1)
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


def _rows(rows: list[int], per_row: int, device) -> slice | torch.Tensor:
    """Flat rows of sequences starting at `rows`, `per_row` tokens each: a slice when they are
    back to back, else an index tensor in sequence-major order."""
    if rows == list(range(rows[0], rows[0] + per_row * len(rows), per_row)):
        return slice(rows[0], rows[0] + per_row * len(rows))
    index = torch.tensor(rows)[:, None] + torch.arange(per_row)[None, :]
    return index.flatten().to(device)


def stack_slots(slots: list[torch.Tensor], length: int) -> torch.Tensor:
    """[B, length] from B sequences' slot lists (each at most `length` long), each padded with
    slot 0; a view of a lone list that needs no padding."""
    if len(slots) == 1 and int(slots[0].shape[0]) == length:
        return slots[0][None]
    if all(int(s.shape[0]) == length for s in slots):
        return torch.stack(slots)
    # one call, not a copy per sequence (32 decoding sequences, 256 keys: 92 -> 57 us)
    kv_slots = torch.nn.utils.rnn.pad_sequence(slots, batch_first=True)
    return F.pad(kv_slots, (0, length - kv_slots.shape[1]))


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _decode_group(chunks, decodes, starts, ctx_lens, device, key_multiple) -> AttentionGroup:
    """Every sequence of the step in the decode group, as one [N, 1, L] batch: one item per
    query row (N = B_d when every sequence has one new token)."""
    rows, lens, row_seq = [], [], []
    for i, b in enumerate(decodes):
        q, length = chunks[b].num_new, ctx_lens[b]
        rows.extend(range(starts[b], starts[b] + q))
        lens.extend(range(length - q + 1, length + 1))  # causal within the new rows
        row_seq.extend([i] * q)
    max_l = _round_up(max(lens), key_multiple)
    kv_slots = stack_slots([chunks[b].kv_slots for b in decodes], max_l)
    if len(rows) > len(decodes):  # a sequence's rows share its context's slots
        kv_slots = kv_slots[torch.tensor(row_seq)]
    mask = None
    if min(lens) != max_l:  # pad keys beyond a sequence's context are masked out
        mask = (torch.arange(max_l)[None, :] < torch.tensor(lens)[:, None])[:, None, :]
        mask = mask.to(device)
    contiguous = rows == list(range(rows[0], rows[0] + len(rows)))
    return AttentionGroup(
        rows=slice(rows[0], rows[0] + len(rows)) if contiguous else torch.tensor(rows).to(device),
        batch_size=len(rows),
        query_len=1,
        kv_slots=kv_slots.to(device=device, dtype=torch.long),
        mask=mask,
        lengths=torch.tensor(lens, dtype=torch.long, device=device),
        causal=False,
        key_limits=None,
        shared_prefix=0,
        sum_query_len=len(rows),
        sum_query_times_context=sum(lens),
        sum_context=sum(lens),
    )


def _shared_prefix(kv_slots: torch.Tensor, length: int, minimum: int) -> int:
    """How many leading positions have the same slot in every row of kv_slots [B, *] (rows
    of `length` real positions), when at least `minimum`; else 0."""
    if minimum <= 0 or kv_slots.shape[0] < 2 or length < minimum:
        return 0
    same = (kv_slots[:, :length] == kv_slots[:1, :length]).all(0)
    shared = length if bool(same.all()) else int(same.logical_not().nonzero()[0])
    return shared if shared >= minimum else 0


def _prefill_group(chunks, starts: list[int], device, layout: AttentionLayout) -> AttentionGroup:
    """Chunks of one shape (q > 1 new tokens, context L), together: [B, q, L]."""
    q, length, b = chunks[0].num_new, int(chunks[0].kv_slots.shape[0]), len(chunks)
    padded = _round_up(length, layout.key_multiple)
    kv_slots = stack_slots([c.kv_slots for c in chunks], padded)
    # query i sits at position L - q + i and sees keys 0 .. L - q + i (the same for every
    # sequence of the group: [1, q, L] broadcasts over the batch); pad keys are never seen
    mask = (torch.arange(padded)[None, :] <= torch.arange(length - q, length)[:, None])[None]
    return AttentionGroup(
        rows=_rows(starts, q, device),
        batch_size=b,
        query_len=q,
        kv_slots=kv_slots.to(device=device, dtype=torch.long),
        mask=mask.to(device),
        lengths=None,
        causal=q == length == padded,
        key_limits=torch.arange(length - q + 1, length + 1, device=device)[None],
        shared_prefix=_shared_prefix(kv_slots, length - q, layout.cascade_min_prefix),
        sum_query_len=b * q,
        sum_query_times_context=b * q * length,
        sum_context=b * length,
    )
