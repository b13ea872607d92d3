"""The absorbed latent path equals the expanded path; batching sequences changes nothing."""

from __future__ import annotations

import pytest
import torch
from helpers import prefill_logits, stepwise_logits

from mci.layers.attention import choose_absorbed
from mci.layers.attention_metadata import AttentionLayout, AttentionMetadata, SequenceChunk
from mci.models.loader import load_model
from mci.tools.make_checkpoint import preset_config

TOL = 1e-4


@pytest.fixture(scope="module")
def model(checkpoint):
    return load_model(checkpoint(), "float32")


@pytest.fixture(scope="module")
def bf16_model(checkpoint):
    """bf16 with the CPU kernels where they run (their prefill attention among them)."""
    model = load_model(checkpoint(dtype="bfloat16"), "bfloat16")
    model.pack_for_cpu()
    return model


def _ids(n, seed=0):
    return torch.randint(0, 2048, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_prefill_absorbed_equals_expanded(model):
    ids = _ids(40)
    a = prefill_logits(model, ids, "absorbed")
    e = prefill_logits(model, ids, "expanded")
    assert (a - e).abs().max().item() <= TOL


@pytest.mark.parametrize("first_chunk", [1, 9])
def test_stepwise_decode_paths_equal_prefill(model, first_chunk):
    ids = _ids(24, seed=1)
    full = prefill_logits(model, ids, "expanded")
    for path in ("absorbed", "expanded", "auto"):
        step = stepwise_logits(model, ids, path, first_chunk)
        assert (step - full).abs().max().item() <= TOL, path


def _batched_step(model, seqs, cached, num_slots, seed, layout=None):
    """Cache each sequence's first `cached` tokens at scattered slots (one forward each), then
    build one step computing every sequence's remaining tokens: (meta, new ids, cache)."""
    cache = model.allocate_kv_cache(num_slots)
    perm = torch.randperm(num_slots, generator=torch.Generator().manual_seed(seed))
    slots, start = [], 0
    for s in seqs:
        slots.append(perm[start : start + len(s)])
        start += len(s)
    for s, sl, c in zip(seqs, slots, cached):
        if c:
            meta = AttentionMetadata.build([SequenceChunk(sl[:c], c)])
            model(torch.tensor(s[:c]), meta, cache, "expanded")
    chunks = [SequenceChunk(sl, len(s) - c) for s, sl, c in zip(seqs, slots, cached)]
    new_ids = torch.tensor([t for s, c in zip(seqs, cached) for t in s[c:]])
    return AttentionMetadata.build(chunks, "cpu", layout or AttentionLayout()), new_ids, cache


def _check_each_alone(model, seqs, cached, step, paths):
    """The batched step gives every sequence the logits it gets alone, on each path."""
    meta, new_ids, cache = step
    for path in paths:
        batched = model.logits(model(new_ids, meta, cache, path))
        offset = 0
        for s, c in zip(seqs, cached):
            alone = prefill_logits(model, s, "expanded")[c:]
            n = len(s) - c
            assert (batched[offset : offset + n] - alone).abs().max().item() <= TOL, path
            offset += n


def test_mixed_batch_equals_each_alone(model):
    """Three sequences in one forward (a fresh prefill, a chunk after a cached prefix, a decode)
    give the logits each gets alone, with scattered, non-contiguous cache slots."""
    seqs = [_ids(11, 2), _ids(17, 3), _ids(6, 4)]
    cached = [0, 9, 5]  # tokens already in cache before the batched step
    step = _batched_step(model, seqs, cached, 64, seed=5)
    _check_each_alone(model, seqs, cached, step, ("absorbed", "expanded"))


@pytest.mark.parametrize("size", ["small", "reference"])
def test_auto_path_picks_absorbed_for_decode_expanded_for_long_prefill(size, reference_config):
    cfg = reference_config if size == "reference" else preset_config(size)
    decode = AttentionMetadata.build([SequenceChunk(torch.arange(500), 1)])
    prefill = AttentionMetadata.build([SequenceChunk(torch.arange(500), 500)])
    assert choose_absorbed(cfg, decode)
    assert not choose_absorbed(cfg, prefill)


def test_metadata_rejects_bad_chunks():
    with pytest.raises(ValueError):
        AttentionMetadata.build([SequenceChunk(torch.arange(3), 4)])
    with pytest.raises(ValueError):
        AttentionMetadata.build([SequenceChunk(torch.arange(3), 0)])


@pytest.mark.parametrize("key_multiple", [1, 16])
def test_decode_step_metadata_is_each_sequences_last_position(key_multiple):
    """A step of single-token decodes (its positions and write slots read off the decode group)
    says what the general layout says: each sequence's new token at position L - 1 of its
    context, written to its last slot, its keys the sequence's slots padded with slot 0."""
    g = torch.Generator().manual_seed(key_multiple)
    lengths = [int(n) for n in torch.randint(1, 70, (9,), generator=g)]
    slots = torch.randperm(1000, generator=g)
    chunks, start = [], 0
    for length in lengths:
        chunks.append(SequenceChunk(slots[start : start + length], 1))
        start += length
    meta = AttentionMetadata.build(chunks, layout=AttentionLayout(key_multiple=key_multiple))
    (group,) = meta.groups
    assert meta.positions.tolist() == [n - 1 for n in lengths]
    assert meta.write_slots.tolist() == [int(c.kv_slots[-1]) for c in chunks]
    assert meta.positions.dtype == meta.write_slots.dtype == torch.long
    width = -(-max(lengths) // key_multiple) * key_multiple
    assert group.kv_slots.shape == (len(chunks), width) and group.lengths.tolist() == lengths
    for row, chunk in zip(group.kv_slots, chunks, strict=True):
        assert torch.equal(row[: len(chunk.kv_slots)], chunk.kv_slots)
        assert not row[len(chunk.kv_slots) :].any()


def test_ragged_groups_interleaved_decodes_equal_each_alone(model):
    """Decodes of different context lengths on both sides of a prefill chunk (the decode group's
    rows are not contiguous) and two prefill chunks: each sequence gets its solo logits."""
    seqs = [_ids(9, 6), _ids(20, 7), _ids(5, 8), _ids(14, 9), _ids(12, 10)]
    cached = [8, 0, 4, 6, 11]  # decode, fresh prefill, decode, chunk after a prefix, decode
    step = _batched_step(model, seqs, cached, 96, seed=11)
    meta = step[0]
    assert len(meta.groups) == 3 and meta.groups[0].batch_size == 3  # decodes, then 2 prefills
    assert not isinstance(meta.groups[0].rows, slice)
    _check_each_alone(model, seqs, cached, step, ("auto", "absorbed", "expanded"))


def test_equal_shaped_prefills_attend_as_one_group(model):
    """A burst of prompts of one length is one batched group; chunks after equal cached
    prefixes too; outputs equal each sequence alone."""
    seqs = [_ids(10, 20 + i) for i in range(3)] + [_ids(12, 30 + i) for i in range(2)]
    cached = [0, 0, 0, 5, 5]
    step = _batched_step(model, seqs, cached, 80, seed=12)
    assert [(g.batch_size, g.query_len) for g in step[0].groups] == [(3, 10), (2, 7)]
    _check_each_alone(model, seqs, cached, step, ("absorbed", "expanded"))


def test_few_row_sequences_attend_per_row_in_the_decode_group(model):
    """With `row_query_max`, sequences of a few new tokens (speculative verifications) join the
    decode group one item per row, each row seeing its causal prefix; longer chunks stay
    prefill groups; every sequence gets its solo logits on each path."""
    seqs = [_ids(9, 40), _ids(20, 41), _ids(12, 42), _ids(14, 43), _ids(30, 44)]
    cached = [8, 0, 9, 11, 10]  # decode, fresh 20, 3 rows, 3 rows, 20 rows after a prefix
    step = _batched_step(model, seqs, cached, 128, seed=13, layout=AttentionLayout(1, 4))
    decode = step[0].groups[0]
    assert [(g.batch_size, g.query_len) for g in step[0].groups] == [(7, 1), (1, 20), (1, 20)]
    assert decode.lengths.tolist() == [9, 10, 11, 12, 12, 13, 14]
    assert decode.rows.tolist() == [0, 21, 22, 23, 24, 25, 26]
    _check_each_alone(model, seqs, cached, step, ("auto", "absorbed", "expanded"))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("own_cached", [0, 3])
def test_cascade_over_a_shared_cached_prefix_equals_each_alone(request, own_cached, dtype):
    """Sequences whose first P context slots are the same cached prefix (a prefix-cache hit of
    several requests) attend to it once (cascade attention) and to their own positions
    separately, merged by log-sum-exp: each gets its solo logits (in bf16, on the CPU
    kernels' prefill attention where they run: within bf16 rounding, the same greedy
    tokens). With `own_cached` tokens of their own already cached, the own part is masked
    rather than plainly causal."""
    model = request.getfixturevalue("model" if dtype == "float32" else "bf16_model")
    tol = TOL if dtype == "float32" else 0.05
    prefix, new = _ids(20, 50), 5
    seqs = [prefix + _ids(own_cached + new, 51 + i) for i in range(3)]
    cache = model.allocate_kv_cache(128)
    model(
        torch.tensor(prefix), AttentionMetadata.build([SequenceChunk(torch.arange(20), 20)]), cache
    )
    chunks = []
    for i, s in enumerate(seqs):
        own = torch.arange(40 + 20 * i, 40 + 20 * i + own_cached + new)
        slots = torch.cat((torch.arange(20), own))
        if own_cached:
            ids = torch.tensor(s[20 : 20 + own_cached])
            meta = AttentionMetadata.build([SequenceChunk(slots[: 20 + own_cached], own_cached)])
            model(ids, meta, cache)
        chunks.append(SequenceChunk(slots, new))
    meta = AttentionMetadata.build(chunks, "cpu", AttentionLayout(cascade_min_prefix=8))
    assert [(g.batch_size, g.shared_prefix) for g in meta.groups] == [(3, 20)]
    new_ids = torch.tensor([t for s in seqs for t in s[-new:]])
    batched = model.logits(model(new_ids, meta, cache))
    for i, s in enumerate(seqs):
        alone = prefill_logits(model, s, "expanded")[-new:]
        assert (batched[i * new : (i + 1) * new] - alone).abs().max().item() <= tol
        assert torch.equal(batched[i * new : (i + 1) * new].argmax(-1), alone.argmax(-1))
