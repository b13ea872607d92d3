"""The skinny-row bf16 kernels (mci/kernels/cpu_kernels.py): exact sums rounded once, rows
independent of each other, experts and heads as segments, and a model using them stays with
the oneDNN model."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import stepwise_logits

from mci.kernels import build, cpu_decoder, cpu_kernels
from mci.layers.attention_metadata import AttentionMetadata, SequenceChunk
from mci.layers.linear import BATCH_INVARIANT_ROWS, Linear, bf16_matmuls_supported, packed_linear
from mci.layers.mlp import GatedMLP
from mci.layers.moe import MoE
from mci.models import deepseek_v3
from mci.models.loader import load_model

matvec = cpu_kernels.load()
pytestmark = pytest.mark.skipif(matvec is None, reason="no AVX512-BF16 or AVX2 CPU, or no compiler")


def _reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """float64 sums of the bf16 products, rounded once to bf16."""
    return (x.double() @ w.double().t()).to(torch.bfloat16)


@pytest.mark.parametrize("k, n", [(512, 512), (256, 1280), (100, 37), (1536, 7), (32, 4)])
def test_linear_is_the_exact_sum_rounded_once_and_rows_are_independent(k, n):
    g = torch.Generator().manual_seed(k + n)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    x = torch.randn(9, k, generator=g).to(torch.bfloat16)
    out = matvec.linear(x, w)
    ref = _reference(x, w)
    # float32 accumulation: at most one bf16 step from the float64 sum, and nearly always on it
    ulp = ref.float().abs().clamp(min=1e-3) * 2.0**-7
    assert ((out.float() - ref.float()).abs() <= ulp).all()
    assert (out == ref).float().mean() > 0.99
    for rows in (1, 2, 3, 5, 9):  # a row's result never depends on the rows beside it
        for start in range(0, 9 - rows + 1, 2):
            assert torch.equal(matvec.linear(x[start : start + rows], w), out[start : start + rows])
    strided = torch.randn(3, 2 * k, generator=g).to(torch.bfloat16)[:, :k]  # row stride 2k
    assert torch.equal(matvec.linear(strided, w), matvec.linear(strided.contiguous(), w))


def _lane_order_sum(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """cpu_matvec.c's sum, step by step in float32: 16 lanes; lane l of each 32-column chunk
    adds the product of columns 2l + 1, then of 2l (each product of two bf16 is exact in
    float32, so each add is the kernel's one rounding), chunk after chunk; then the lanes
    summed pairwise (l and l + 8, then 4 apart, 2, 1) and rounded once to bf16."""
    m, k = x.shape
    pad = (-k) % 32
    xs = torch.nn.functional.pad(x.float(), (0, pad)).view(m, 1, -1, 16, 2)
    ws = torch.nn.functional.pad(w.float(), (0, pad)).view(1, w.shape[0], -1, 16, 2)
    acc = torch.zeros(m, w.shape[0], 16)
    for c in range(xs.shape[2]):
        acc = acc + xs[:, :, c, :, 1] * ws[:, :, c, :, 1]
        acc = acc + xs[:, :, c, :, 0] * ws[:, :, c, :, 0]
    for half in (8, 4, 2, 1):
        acc = acc[..., :half] + acc[..., half : 2 * half]
    return acc[..., 0].to(torch.bfloat16)


@pytest.mark.skipif(
    matvec is None or matvec.isa != "avx512" or "GenuineIntel" not in build.cpu_flags(),
    reason="the AVX-512 build on an Intel CPU (elsewhere the tuned build is the plain one)",
)
def test_the_vendor_tuned_build_gives_the_untuned_builds_bits():
    """The build an Intel CPU gets (the matvec prefetches 4 KB ahead of its passes over the
    weight rows) is another library, and sums exactly as the plain build (AMD's) does: one row
    of x, several rows' first pass, the later passes' one-row tails (9 and 17 rows), and k with
    and without a tail."""
    tuned, untuned = build.built_library("avx512"), build.built_library("avx512", tuned=False)
    assert tuned != untuned
    # the library this process loaded for its kernels (cpu_kernels.load) is the tuned one
    assert str(tuned) in Path("/proc/self/maps").read_text()
    plain = cpu_kernels.CpuKernels(ctypes.CDLL(str(untuned)), "avx512", False, False)
    g = torch.Generator().manual_seed(11)
    shapes = [(1, 416, 512), (1, 8192, 512), (1, 768, 256), (3, 300, 200), (8, 520, 512)]
    for m, n, k in [*shapes, (9, 300, 200), (17, 520, 512)]:
        x = torch.randn(m, k, generator=g).bfloat16()
        w = torch.randn(n, k, generator=g).bfloat16()
        assert torch.equal(matvec.linear(x, w), plain.linear(x, w)), (m, n, k)


@pytest.mark.parametrize(
    "k, n", [(512, 64), (100, 37), (33, 9), (512, 1100), (256, 1050), (33000, 9)]
)
def test_linear_sums_in_the_documented_order(k, n):
    """Each output is the documented float32 sum rounded once, whatever order the weight rows
    are read in and on either build (AVX-512, AVX2): in one pass of rows of x or several (the
    AVX-512 build takes up to 8 at a time, and above 8 goes over a thread's weight rows in
    blocks of 64 KB (16 rows where those are more: k = 33,000), two rows side by side after
    the first pass, with 1-8 rows in the later passes), in groups of weight rows or one by
    one; n = 1,100 and 1,050 give every thread several blocks at up to 8 threads. Random sums
    seldom tell two summation orders apart after rounding to bf16; the test below has one
    that does."""
    g = torch.Generator().manual_seed(7 * k + n)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    for rows in (1, 2, 3, 4, 5, 7, 8, 9, 10, 11, 13, 14, 15, 16, 17, 21, 33):
        x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
        assert torch.equal(matvec.linear(x, w), _lane_order_sum(x, w))


def test_linear_order_shows_where_float32_rounds():
    """Random sums rarely tell orders apart once rounded to bf16, so one that does: lane 0
    holds 2^20 after the first chunk; the second adds -2^20 (column 33, odd: first) and then
    1 + 2^-7 (column 32), which survives. Even first, 2^20 + 1 + 2^-7 would round to
    2^20 + 1 in float32 and leave 1.0."""
    w = torch.zeros(2, 64)
    w[:, 1], w[:, 33], w[:, 32] = 2.0**20, -(2.0**20), 1 + 2.0**-7
    x = torch.ones(3, 64, dtype=torch.bfloat16)
    out = matvec.linear(x, w.to(torch.bfloat16))
    assert torch.equal(out, torch.full((3, 2), 1 + 2.0**-7, dtype=torch.bfloat16))


def test_expert_linear_runs_each_segment_through_its_expert():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(6, 96, 160, generator=g).to(torch.bfloat16)
    x = torch.randn(7, 160, generator=g).to(torch.bfloat16)
    segments = torch.tensor([[4, 0, 5], [0, 3, 4], [3, 1, 3]])  # expert, first row, rows
    out = matvec.expert_linear(x, w, segments)
    expected = torch.cat(
        [matvec.linear(x[0:3], w[4]), matvec.linear(x[3:4], w[0]), matvec.linear(x[4:7], w[5])]
    )
    assert torch.equal(out, expected)


def test_expert_combine_is_the_weighted_index_add_bit_for_bit():
    """The MoE's weighted sum of expert outputs, done by the kernel as it writes them, equals
    mci/layers/moe.py's float32 index_add over the bf16 outputs exactly."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(6, 96, 160, generator=g).to(torch.bfloat16)
    x = torch.randn(7, 160, generator=g).to(torch.bfloat16)
    segments = torch.tensor([[4, 0, 5], [0, 3, 4], [3, 1, 3]])
    tokens = torch.tensor([0, 2, 1, 0, 2, 1, 0])  # each row's token (3 tokens, top-k 2-3)
    weights = torch.rand(7, generator=g) * 2.5
    y = matvec.expert_linear(x, w, segments)
    expected = torch.zeros(3, 96).index_add_(0, tokens, y.float() * weights[:, None])
    out = matvec.expert_linear_combine(x, w, segments, tokens, weights, torch.zeros(3, 96))
    assert torch.equal(out, expected)
    # busier experts (13 and 6 rows: several passes over blocks of weight rows), wider ones
    w = torch.randn(3, 700, 160, generator=g).to(torch.bfloat16)
    x = torch.randn(19, 160, generator=g).to(torch.bfloat16)
    segments = torch.tensor([[2, 0], [0, 13], [13, 6]])
    tokens = torch.randint(0, 5, (19,), generator=g)
    weights = torch.rand(19, generator=g) * 2.5
    y = matvec.expert_linear(x, w, segments)
    expected = torch.zeros(5, 700).index_add_(0, tokens, y.float() * weights[:, None])
    out = matvec.expert_linear_combine(x, w, segments, tokens, weights, torch.zeros(5, 700))
    assert torch.equal(out, expected)


@pytest.mark.parametrize("amx", [False, True])
@pytest.mark.parametrize(
    "heads,d,c",
    [(8, 160, 128), (3, 33, 17), (12, 96, 80), (16, 576, 512)],  # `small`; odd tails; V3's
)
def test_latent_decode_attention_reads_the_cache_through_slots(heads, d, c, amx):
    """Equal to softmax attention over the gathered rows (float64 reference), within bf16
    rounding; padding slots past a sequence's length are never read; sequences independent.
    Shapes with partial blocks (heads not a multiple of 8, d of 32, c of 32; lengths not of
    16) go through the kernel's repeated-key and repeated-head paths. With `amx` (where the
    CPU has it and d and c are multiples of 32) on AMX tiles, a sequence alone on the same
    path, with the same bits, as in a batch."""
    g = torch.Generator().manual_seed(1)
    scale = 0.1
    cache = torch.randn(300, d, generator=g).to(torch.bfloat16)
    lengths = torch.tensor([37, 1, 200, 16])
    slots = torch.zeros(4, 200, dtype=torch.long)
    for b, n in enumerate(lengths.tolist()):
        slots[b, :n] = torch.randperm(299, generator=g)[:n] + 1
    slots[0, 37:] = 10**9  # never read: far outside the cache
    q = torch.randn(4, heads, d, generator=g).to(torch.bfloat16)
    out = matvec.latent_decode_attention(q, cache, slots, lengths, c, scale, amx)
    for b, n in enumerate(lengths.tolist()):
        rows = cache[slots[b, :n]].double()  # [n, d]
        p = torch.softmax(q[b].double() @ rows.t() * scale, dim=-1)
        ref = p @ rows[:, :c]
        # on AMX, P is rounded to bf16 before P V: a bf16 step of a probability more
        tol = 0.01 + (2**-8 * rows[:, :c].abs().max().item() if amx else 0.0)
        assert (out[b].double() - ref).abs().max() < tol, b
        pick = slice(b, b + 1)
        alone = matvec.latent_decode_attention(
            q[pick], cache, slots[pick], lengths[pick], c, scale, amx
        )
        assert torch.equal(alone[0], out[b])
    wide = cpu_kernels.MAX_LATENT + 16  # past the kernel's buffers: refused, never overrun
    big = torch.zeros(4, wide + 32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="value_dim"):
        matvec.latent_decode_attention(
            big[None, :1].repeat(1, 2, 1), big, slots[:1, :1] * 0, lengths[:1] * 0 + 1, wide, scale
        )


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_kernel_takes_the_eager_steps(x_dtype, out_dtype):
    """Within float32 rounding of the eager RMSNorm (the sum of squares may be added in
    another order), over strided rows (a slice of a fused projection's output), of any width."""
    from mci.layers.norm import RMSNorm

    g = torch.Generator().manual_seed(2)
    for n in (512, 128, 37):
        norm = RMSNorm(n, 1e-6, torch.bfloat16)
        norm.weight.data = torch.randn(n, generator=g).to(torch.bfloat16)
        x = (3 * torch.randn(70, n + 24, generator=g)).to(x_dtype)[:, 5 : 5 + n]
        eager = norm(x, out_dtype)
        assert norm.use_kernels(matvec)
        fused = norm(x, out_dtype)
        norm.use_kernels(None)
        assert fused.dtype == out_dtype and fused.shape == eager.shape
        tolerance = 2.0**-7 if out_dtype == torch.bfloat16 else 1e-5
        assert torch.allclose(fused.float(), eager.float(), rtol=tolerance, atol=1e-6)
        if out_dtype == torch.bfloat16:  # float32 rows differ in the last bit of the scale
            assert (fused == eager).float().mean() > 0.95


def _both_builds():
    """This machine's kernels and the AVX2 build (which CPUs without AVX-512 load)."""
    avx2 = ctypes.CDLL(str(build.built_library("avx2")))
    return [matvec, cpu_kernels.CpuKernels(avx2, "avx2", False, False)]


@pytest.mark.parametrize("addend_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_add_then_norm_is_the_residual_add_and_the_norm_bit_for_bit(addend_dtype, out_dtype):
    """RMSNorm.add_then_norm on the kernels (one pass a row): the sum is torch's x + a, and
    its norm the kernels' norm of that sum, bit for bit, in both builds, over strided rows
    and widths that are not a multiple of 16."""
    from mci.layers.norm import RMSNorm

    g = torch.Generator().manual_seed(3)
    for kernels in _both_builds():
        for n in (512, 100, 7):
            norm = RMSNorm(n, 1e-6, torch.bfloat16)
            norm.weight.data = torch.randn(n, generator=g).to(torch.bfloat16)
            assert norm.use_kernels(kernels)
            x = (5 * torch.randn(40, n + 8, generator=g))[:, 3 : 3 + n]  # row stride n + 8
            a = (5 * torch.randn(40, n, generator=g)).to(addend_dtype)
            total, normed = norm.add_then_norm(x, a, out_dtype)
            assert torch.equal(total, x + a)
            assert torch.equal(normed, norm(x + a, out_dtype))
            assert normed.dtype == out_dtype


@pytest.mark.parametrize("b, q, heads, dv", [(31, 32, 8, 64), (2, 7, 3, 40), (1, 9, 2, 17)])
def test_cascade_merge_on_the_kernels_is_the_torch_merge_bit_for_bit(b, q, heads, dv):
    """merge_partials (cascade attention's log-sum-exp merge of its two partial results, in
    their own layouts) gives the bits of the torch ops it stands in for, in both builds."""
    g = torch.Generator().manual_seed(b * q + dv)
    n = b * q
    first = (3 * torch.randn(1, heads, n, dv, generator=g)).bfloat16()
    second = (3 * torch.randn(b, heads, q, dv, generator=g)).bfloat16()
    lse_p = (5 * torch.randn(heads, n, generator=g)).transpose(0, 1)
    lse_r = (5 * torch.randn(b, heads, q, generator=g)).transpose(1, 2).reshape(n, heads)
    top = torch.maximum(lse_p, lse_r)
    w_p, w_r = (lse_p - top).exp(), (lse_r - top).exp()
    out = first[0].transpose(0, 1).float() * w_p[..., None]
    out = out + second.transpose(1, 2).reshape(n, heads, dv).float() * w_r[..., None]
    ref = (out / (w_p + w_r)[..., None]).to(torch.bfloat16)
    for kernels in _both_builds():
        assert torch.equal(kernels.merge_partials(first, second, w_p, w_r), ref)


@pytest.mark.parametrize("t", [5, 60])
@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("r", [32, 40])
def test_rope_and_latent_rows_are_the_eager_values(interleave, t, r):
    """q's rotation and the rotated k_rope written to the cache equal mci/layers' eager
    computations exactly (16 pairs at a time, then one at a time: r 40); the normalised c_kv
    beside it is within one bf16 step (the sum of squares is added in another order) and
    nearly always equal (60 rows: split over the threads)."""
    from mci.layers.norm import RMSNorm
    from mci.layers.rotary import apply_rope

    g = torch.Generator().manual_seed(6)
    heads, nope, c = 8, 64, 128
    q = torch.randn(t, heads, nope + r, generator=g).to(torch.bfloat16)
    q_rope = q[..., nope:]  # strided, as the model's split leaves it
    angles = torch.rand(t, r // 2, generator=g) * 6
    cos, sin = angles.cos(), angles.sin()
    eager = apply_rope(q_rope, cos[:, None], sin[:, None], interleave).to(torch.bfloat16)
    assert torch.equal(matvec.rope_heads(q_rope, cos, sin, interleave), eager)

    fused = torch.randn(t, 256 + c + r, generator=g).to(torch.bfloat16)
    latent = fused[:, 256:]  # row stride 256 + c + r
    norm = RMSNorm(c, 1e-6, torch.bfloat16)
    norm.weight.data = torch.randn(c, generator=g).to(torch.bfloat16)
    k_rope = apply_rope(latent[:, c:], cos, sin, interleave)
    rows = torch.cat((norm(latent[:, :c], torch.float32), k_rope), dim=-1).to(torch.bfloat16)
    slots = torch.randperm(2 * t, generator=g)[:t]
    cache = torch.zeros(2 * t, c + r, dtype=torch.bfloat16)
    matvec.write_latent_rows(latent, norm.weight, norm.eps, cos, sin, interleave, cache, slots)
    written = cache[slots]
    assert torch.equal(written[:, c:], rows[:, c:])
    assert torch.allclose(written[:, :c].float(), rows[:, :c].float(), rtol=2.0**-7, atol=0)
    assert (written[:, :c] == rows[:, :c]).float().mean() > 0.95
    untouched = torch.ones(2 * t, dtype=torch.bool)
    untouched[slots] = False
    assert not cache[untouched].any()


@pytest.mark.parametrize("amx", [False, True])
@pytest.mark.parametrize(
    "b, h, q, length, d, dv, shared",
    [
        (1, 4, 70, 70, 96, 64, True),
        (2, 3, 9, 41, 48, 32, True),
        (3, 2, 5, 33, 20, 20, False),
        (2, 3, 45, 77, 64, 32, False),  # on AMX where it runs: a whole and a partial block
    ],
)
def test_prefill_attention_is_a_float32_softmax_rounded_once(
    b, h, q, length, d, dv, shared, amx, monkeypatch
):
    """Scores and softmax in float32 over each row's first `limits` keys (causal, ragged,
    lengths not a multiple of 16), P rounded once to bf16 and times V: within bf16 rounding
    of a float64 reference, the log-sum-exp within float32 rounding, also when the rows go
    in chunks of 8 (P's memory bound); a row's result does not depend on the others. `amx`:
    on AMX tiles where the CPU has them and d, dv are multiples of 32 (else the same path)."""
    g = torch.Generator().manual_seed(b * 100 + q)
    qs, ks = torch.randn(b, h, q, d, generator=g), torch.randn(b, h, length, d, generator=g)
    vs = torch.randn(b, h, length, dv, generator=g)
    qs, ks, vs = (t.to(torch.bfloat16) for t in (qs, ks, vs))
    if shared:  # a prefill group's causal rows: the last q positions of the context
        limits = torch.arange(length - q + 1, length + 1)[None]
    else:
        limits = torch.randint(1, length + 1, (b, q), generator=g)
    scale = d**-0.5
    run = matvec.prefill_attention
    monkeypatch.setattr(matvec, "prefill_attention", lambda *a: run(*a, amx))
    out, lse = matvec.prefill_attention(qs, ks, vs, limits, scale)
    scores = qs.double() @ ks.double().transpose(-1, -2) * scale
    seen = torch.arange(length)[None, None, None, :] < limits[:, None, :, None]
    scores = scores.masked_fill(~seen, float("-inf"))
    ref = scores.softmax(-1) @ vs.double()
    assert (out.double() - ref).abs().max() < 0.02  # P and the output each rounded to bf16
    assert (lse.double() - scores.logsumexp(-1)).abs().max() < 1e-5
    monkeypatch.setattr(cpu_kernels, "PREFILL_PROBS_BYTES", 1)  # chunks of 8 query rows
    chunked, chunked_lse = matvec.prefill_attention(qs, ks, vs, limits, scale)
    assert (chunked.double() - ref).abs().max() < 0.02
    assert torch.equal(chunked_lse, lse)  # the kernel's rows: the same bits
    monkeypatch.setattr(cpu_kernels, "PREFILL_PROBS_BYTES", 64 << 20)
    # read in place through any strides (the transposed views the model passes), or copied
    # where a row's pairs would not be 4-byte aligned: the same bits
    q_t = qs.transpose(1, 2).contiguous().transpose(1, 2)
    k_t = ks.transpose(1, 2).contiguous().transpose(1, 2)
    odd = torch.cat((torch.zeros(1, dtype=torch.bfloat16), ks.reshape(-1)))[1:].view(ks.shape)
    assert cpu_kernels._pairs_aligned(q_t) is q_t and cpu_kernels._pairs_aligned(k_t) is k_t
    for q_in, k_in in ((q_t, k_t), (qs, odd)):
        strided, strided_lse = matvec.prefill_attention(q_in, k_in, vs, limits, scale)
        assert torch.equal(strided, out) and torch.equal(strided_lse, lse)
    rows = slice(1, 3)  # the same rows alone: the same bits
    alone, _ = matvec.prefill_attention(qs[:, :, rows], ks, vs, limits[:, rows].contiguous(), scale)
    assert torch.equal(alone, out[:, :, rows])


@pytest.mark.skipif(matvec is None or not matvec.amx, reason="no AMX")
@pytest.mark.parametrize("nq, length", [(992, 1024), (70, 70), (33, 200)])
def test_prefill_attention_on_amx_is_the_vdpbf16ps_path_within_rounding(nq, length):
    """The AMX path (scores, softmax and P V in one call) against the vdpbf16ps path with
    oneDNN's bmm, causal and full rows: the log-sum-exp within float32 rounding (the scores'
    sums in another order); outputs nearly all equal, and apart by at most what one bf16 step
    of a probability moves them (a score's last float32 bit can move P's rounding)."""
    g = torch.Generator().manual_seed(nq)
    qs = torch.randn(1, 8, nq, 96, generator=g).to(torch.bfloat16)
    ks = torch.randn(1, 8, length, 96, generator=g).to(torch.bfloat16)
    vs = torch.randn(1, 8, length, 64, generator=g).to(torch.bfloat16)
    for limits in (torch.full((1, nq), length), torch.arange(length - nq + 1, length + 1)[None]):
        amx, amx_lse = matvec.prefill_attention(qs, ks, vs, limits, 96**-0.5, True)
        old, old_lse = matvec.prefill_attention(qs, ks, vs, limits, 96**-0.5, False)
        assert (amx_lse - old_lse).abs().max() < 1e-5
        assert (amx.float() - old.float()).abs().max() <= 2**-8 * vs.float().abs().max()
        assert (amx == old).float().mean() > 0.99


@pytest.mark.skipif(matvec is None or not matvec.amx, reason="no AMX")
@pytest.mark.parametrize("heads, d, c", [(8, 160, 128), (40, 576, 512)])  # `small`; V3's
def test_latent_decode_attention_on_amx_is_the_passes_within_rounding(heads, d, c):
    """The AMX path against the vdpbf16ps passes: apart by at most what one bf16 step of a
    probability moves an output (P is rounded to bf16 before P V there, kept in float32
    here); lengths across AMX_KEYS' blocks and partial 16- and 32-key blocks, 40 heads over
    two work items (32 and 8). A sequence past AMX_MAX_KEYS (4,096) stays on the passes, bit
    for bit. A sequence's bits are its own whatever the batch and the threads: alone (its
    keys, heads and value columns split over the threads) as in a batch of five, and on one
    thread as on all (the split path and the work-item path)."""
    g = torch.Generator().manual_seed(heads)
    cache = torch.randn(6000, d, generator=g).to(torch.bfloat16)
    lengths = torch.tensor([1, 17, 300, 513, 4097])
    slots = torch.stack([torch.randperm(6000, generator=g)[:4097] for _ in lengths])
    q = torch.randn(len(lengths), heads, d, generator=g).to(torch.bfloat16)
    scale = d**-0.5
    amx = matvec.latent_decode_attention(q, cache, slots, lengths, c, scale, True)
    old = matvec.latent_decode_attention(q, cache, slots, lengths, c, scale, False)
    values = cache[:, :c].float().abs().max()
    assert (amx[:4].float() - old[:4].float()).abs().max() <= 2**-8 * values
    assert not torch.equal(amx[:4], old[:4])  # the AMX path ran
    assert torch.equal(amx[4], old[4])  # past AMX_MAX_KEYS
    threads = torch.get_num_threads()
    for b in range(len(lengths)):  # alone; 513 keys split over the threads (8 heads)
        pick = slice(b, b + 1)
        one = matvec.latent_decode_attention(
            q[pick], cache, slots[pick], lengths[pick], c, scale, True
        )
        assert torch.equal(one[0], amx[b]), b
    pair = [3, 4]  # 513 keys on AMX, 4,097 past it
    # 1 thread: the work-item path for both calls. 4 threads: the batch still has a work
    # item per thread; the pair has fewer, so 513 keys split over 4 threads (chunks of 160
    # keys, against 256 at 2) and 4,097 on the passes after it (for 8 heads; 40 heads give
    # the pair 4 items, the work-item path again)
    for n in (1, 4):
        torch.set_num_threads(n)
        try:
            every = matvec.latent_decode_attention(q, cache, slots, lengths, c, scale, True)
            two = matvec.latent_decode_attention(
                q[pair], cache, slots[pair], lengths[pair], c, scale, True
            )
        finally:
            torch.set_num_threads(threads)
        assert torch.equal(every, amx) and torch.equal(two, amx[pair]), n


@pytest.mark.parametrize("length", [16, 37, 130])
def test_pack_values_is_amx_pair_interleaved_layout(length):
    """mci_pack_values writes values [B, H, L, dv] (a transposed view read in place) as
    [B*H, dv/16, ceil(L/32), 16, 16, 2] (pairs of keys interleaved per 16 columns) with zero
    keys past L: torch's permutation of the same tensor, bit for bit."""
    b, h, dv = 2, 3, 64
    g = torch.Generator().manual_seed(length)
    values = torch.randn(b, length, h, dv, generator=g).to(torch.bfloat16).transpose(1, 2)
    chunks = -(-length // 32)
    want = F.pad(values, (0, 0, 0, chunks * 32 - length)).reshape(
        b * h, chunks, 16, 2, dv // 16, 16
    )
    want = want.permute(0, 4, 1, 2, 5, 3).contiguous()
    got = torch.full_like(want, float("nan"))
    status = matvec._pack_values(
        values.data_ptr(), *values.stride()[:3], b, h, length, dv, got.data_ptr()
    )
    assert status == 0
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("length", [16, 37, 130])
@pytest.mark.parametrize("expanded", [False, True])
@pytest.mark.parametrize("d", [96, 100])
def test_pack_keys_is_the_pair_interleaved_block_layout(length, expanded, d):
    """mci_pack_keys writes keys [B, H, L, d] (a transposed view read in place, or one head
    expanded over all: stride 0) as [B*H, ceil(L/16), d/2, 16, 2] with zero keys past L:
    torch's permutation of the same tensor, bit for bit (130 keys: split over the threads;
    d 100: 48 pairs transposed 16 at a time, then 2 one at a time)."""
    b, h = 2, 8
    g = torch.Generator().manual_seed(length)
    keys = torch.randn(b, length, h, d, generator=g).to(torch.bfloat16).transpose(1, 2)
    if expanded:
        keys = keys[:, :1].expand(b, h, length, d)
    blocks = -(-length // 16)
    want = F.pad(keys, (0, 0, 0, blocks * 16 - length)).reshape(b * h, blocks, 16, d // 2, 2)
    want = want.transpose(2, 3).contiguous()
    got = torch.full_like(want, float("nan"))
    status = matvec._pack_keys(keys.data_ptr(), *keys.stride()[:3], b, h, length, d, got.data_ptr())
    assert status == 0
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


@pytest.mark.skipif(
    matvec is not None and matvec.isa == "avx2",
    reason="the AVX2 build leaves prefill attention on the flash kernel (faster there)",
)
def test_prefill_attention_on_the_kernels_stays_with_the_flash_kernel(checkpoint, monkeypatch):
    """A bf16 model's prefill chunks (plain causal, then after cached tokens of its own)
    give the same logits within bf16 rounding with the kernel's prefill attention as with
    torch's flash kernel, and the same greedy tokens."""
    path = checkpoint(dtype="bfloat16")
    model = load_model(path, "bfloat16")
    model.pack_for_cpu()
    ids = torch.randint(0, 2048, (40,), generator=torch.Generator().manual_seed(7)).tolist()

    def logits() -> torch.Tensor:
        cache, out, done = model.allocate_kv_cache(len(ids)), [], 0
        for n in (24, 16):
            meta = AttentionMetadata.build([SequenceChunk(torch.arange(done + n), n)])
            hidden = model(torch.tensor(ids[done : done + n]), meta, cache, "expanded")
            out.append(model.logits(hidden))
            done += n
        return torch.cat(out)

    calls = []
    run = matvec.prefill_attention
    monkeypatch.setattr(matvec, "prefill_attention", lambda *a: calls.append(1) or run(*a))
    kernel = logits()
    assert calls  # the kernel's path was taken
    for module in model.modules():
        if hasattr(module, "_prefill_kernels"):  # as without the CPU kernels: flash
            monkeypatch.setattr(module, "_prefill_kernels", lambda q: None)
    flash = logits()
    assert (kernel - flash).abs().max() < 0.05
    assert torch.equal(kernel.argmax(-1), flash.argmax(-1))


def test_a_model_on_the_kernels_stays_with_the_onednn_model(checkpoint):
    """Decode steps (one row) take the kernels; their logits stay within bf16 rounding of the
    oneDNN-only model's, step after step."""
    path = checkpoint(dtype="bfloat16")
    ids = torch.randint(0, 2048, (24,), generator=torch.Generator().manual_seed(5)).tolist()
    onednn = load_model(path, "bfloat16")
    onednn.pack_for_cpu(skinny_kernels=False)
    kernels = load_model(path, "bfloat16")
    kernels.pack_for_cpu()
    assert any(getattr(m, "matvec", None) is not None for m in kernels.modules())
    a = stepwise_logits(onednn, ids, "auto", first_chunk=4)
    b = stepwise_logits(kernels, ids, "auto", first_chunk=4)
    assert (a - b).abs().max() < 0.05
    assert torch.equal(a.argmax(-1), b.argmax(-1))
    if not bf16_matmuls_supported():  # the AVX2 build: that mode needs oneDNN's bf16
        with pytest.raises(ValueError, match="batch-invariant"):
            kernels.set_batch_invariant(True)
        return
    kernels.set_batch_invariant(True)  # batch-invariant mode keeps oneDNN's kernel throughout
    assert all(m.skinny(1) is None for m in kernels.modules() if hasattr(m, "skinny"))


def test_verification_rows_read_in_place_stay_with_the_onednn_model(checkpoint):
    """A step of speculative verifications (3 and 4 rows after cached prefixes) beside a decode:
    on the kernels the rows attend in place in the decode group; each row's logits stay within
    bf16 rounding of the oneDNN model's (where each verification is a prefill group)."""
    path = checkpoint(dtype="bfloat16")
    gen = torch.Generator().manual_seed(8)
    seqs = [torch.randint(0, 2048, (n,), generator=gen) for n in (15, 21, 11)]
    cached = [12, 17, 10]
    models = [load_model(path, "bfloat16") for _ in range(2)]
    models[0].pack_for_cpu(skinny_kernels=False)
    models[1].pack_for_cpu()
    assert models[1].attention_layout.row_query_max > 4 >= models[0].attention_layout.row_query_max
    logits = []
    for model in models:
        cache = model.allocate_kv_cache(64)
        slots = [torch.arange(i * 21, i * 21 + len(s)) for i, s in enumerate(seqs)]
        for s, sl, c in zip(seqs, slots, cached):
            model(s[:c], AttentionMetadata.build([SequenceChunk(sl[:c], c)]), cache)
        chunks = [SequenceChunk(sl, len(s) - c) for s, sl, c in zip(seqs, slots, cached)]
        meta = AttentionMetadata.build(chunks, "cpu", model.attention_layout)
        new = torch.cat([s[c:] for s, c in zip(seqs, cached)])
        logits.append(model.logits(model(new, meta, cache)))
    assert len(AttentionMetadata.build(chunks, "cpu", models[1].attention_layout).groups) == 1
    assert (logits[0] - logits[1]).abs().max() < 0.05
    # the greedy token wherever the reference's choice is not a near-tie (one row of this
    # seed ties exactly in bf16, and the two paths may break the tie either way)
    top2 = logits[0].topk(2, -1).values
    decided = top2[:, 0] - top2[:, 1] > 0.06
    assert decided.sum() >= 6
    assert torch.equal(logits[0].argmax(-1)[decided], logits[1].argmax(-1)[decided])


def _packed_moe(checkpoint, size: str) -> tuple:
    """(model, its first MoE block) of a bf16 checkpoint packed for the CPU kernels."""
    model = load_model(checkpoint(size=size, dtype="bfloat16"), "bfloat16")
    model.pack_for_cpu()
    return model, next(m for m in model.modules() if isinstance(m, MoE))


def _general_path(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """The MoE block's output on its torch paths (not the one-call kernel)."""
    moe.bound_call = lambda rows: None
    try:
        return moe(x)
    finally:
        del moe.bound_call


@pytest.mark.parametrize("size", ["tiny", "small"])
def test_one_call_moe_and_gated_mlp_take_the_eager_steps(checkpoint, size):
    """The MoE block in one kernel call (cpu_moe.c) routes every token to the experts the
    router picks, with its weights, and sums them as the general path does (float32 rounding
    apart); the gated MLP in one call is bit for bit the eager one. An expert over the row
    limit goes to the bf16 GEMM (AVX-512 build: within bf16 rounding of the skinny kernels'
    result), or returns the routing only (AVX2)."""
    model, moe = _packed_moe(checkpoint, size)
    mlp = next(m for m in model.modules() if isinstance(m, GatedMLP))
    g = torch.Generator().manual_seed(4)
    with torch.inference_mode():
        for t in (1, 5, 12):
            x = torch.randn(t, model.cfg.hidden_size, generator=g) * 2
            assert moe.bound_call(t) is not None
            fused = moe(x)
            weights, ids = moe.gate(x)
            experts = moe.experts.gate_up_proj.weight, moe.experts.down_proj.weight
            skinny, k_weights, k_ids = matvec.moe(
                x, moe.gate.logits(x), moe.gate, experts, None, None, 16
            )  # routed experts only (no shared ones)
            assert torch.equal(k_ids.sort(-1).values, ids.sort(-1).values)
            order = (k_ids[:, :, None] == ids[:, None, :]).float().argmax(-1)
            assert torch.allclose(k_weights, weights.gather(1, order), rtol=1e-6, atol=0)
            out, _, _ = matvec.moe(x, moe.gate.logits(x), moe.gate, experts, None, None, 0)
            reference = _general_path(moe, x)
            assert (fused - reference).abs().max() <= 1e-6 * reference.abs().max()
            if not matvec.gemm:
                assert out is None  # every expert is over a limit of 0 rows: no GEMM here
            else:  # every expert on the GEMM: its sums in another order, rounded to bf16
                assert (out - skinny).abs().max() <= 2**-7 * skinny.abs().max()
                logits = moe.gate.logits(x)  # the same router row for both calls
                out, _, _ = matvec.moe(x, logits, moe.gate, experts, None, None, 0)
                alone, _, _ = matvec.moe(x[-1:], logits[-1:], moe.gate, experts, None, None, 0)
                assert torch.equal(alone[0], out[-1])  # whatever else shares the call
            xb = x.to(torch.bfloat16)
            gate, up = mlp.gate_up_proj(xb).chunk(2, dim=-1)
            eager = mlp.down_proj(torch.nn.functional.silu(gate) * up)
            assert torch.equal(mlp(xb), eager)


@pytest.mark.parametrize(
    "config",
    [
        {"size": "tiny"},
        {"size": "small"},
        {"size": "tiny", "q_lora_rank": None},
        # 3 heads: a thread's run of the heads' weight rows ends inside a head (per_head); with
        # odd latent and value sizes, at a row that is no multiple of 4 within it
        {"size": "tiny", "num_attention_heads": 3},
        {"size": "tiny", "num_attention_heads": 3, "kv_lora_rank": 26, "v_head_dim": 30},
    ],
)
def test_attention_in_one_call_is_the_kernel_path_bit_for_bit(checkpoint, config, monkeypatch):
    """A decode step (one row per sequence, or a verification's few) with the attention
    sublayer in one call (cpu_mla.c) gives the same logits and writes the same latents as the
    layer's kernel path op by op; a step with a prefill chunk does not take it."""
    from mci.layers.attention import MultiHeadLatentAttention

    model = load_model(checkpoint(dtype="bfloat16", **config), "bfloat16")
    model.pack_for_cpu()
    monkeypatch.setattr(model, "_decode_on_kernels", lambda *args: None)  # layer by layer
    one_call = MultiHeadLatentAttention.decode_in_one_call
    calls = []

    def counted(*args):
        out = one_call(*args)
        calls.append(out is not None)
        return out

    for q_rows in (1, 3):
        results = []
        for fn in (counted, lambda *args: None):
            monkeypatch.setattr(MultiHeadLatentAttention, "decode_in_one_call", fn)
            cache = model.allocate_kv_cache(256)
            cache.copy_(torch.randn(cache.shape, generator=torch.Generator().manual_seed(2)))
            chunks = [
                SequenceChunk(torch.arange(b * 60, b * 60 + 40 + 7 * b), q_rows) for b in range(3)
            ]
            meta = AttentionMetadata.build(chunks, "cpu", model.attention_layout)
            ids = torch.randint(0, 2048, (3 * q_rows,), generator=torch.Generator().manual_seed(3))
            with torch.inference_mode():
                results.append((model.logits(model(ids, meta, cache)), cache))
        assert torch.equal(results[0][0], results[1][0]) and torch.equal(
            results[0][1], results[1][1]
        )
    assert calls and all(calls)
    calls.clear()
    monkeypatch.setattr(MultiHeadLatentAttention, "decode_in_one_call", counted)
    prefill = AttentionMetadata.build(
        [SequenceChunk(torch.arange(30), 30)], "cpu", model.attention_layout
    )
    with torch.inference_mode():
        model(torch.arange(30), prefill, model.allocate_kv_cache(64))
    assert calls and not any(calls)


@pytest.mark.parametrize(
    "config",
    [
        {"size": "tiny"},
        {"size": "small"},
        {"size": "tiny", "num_hidden_layers": 3, "first_k_dense_replace": 0},  # MoE only
        {"size": "tiny", "num_hidden_layers": 3, "first_k_dense_replace": 3},  # dense only
        # dense, dense, MoE, dense: a span finishing a MoE goes on through dense layers
        {"size": "tiny", "num_hidden_layers": 4, "moe_layer_freq": 2},
        {"size": "tiny", "q_lora_rank": None},
        pytest.param(
            {"size": "tiny", "fp8": True, "num_hidden_layers": 4, "moe_layer_freq": 2},
            marks=pytest.mark.skipif(matvec is None or not matvec.fp8, reason="no FP8 kernels"),
        ),
    ],
)
@pytest.mark.parametrize("whole_step", [True, False])
def test_a_decode_step_of_bound_kernel_calls_is_the_layers_bit_for_bit(
    checkpoint, config, whole_step, monkeypatch
):
    """A decode step whose every layer runs on the kernels goes through the decoder spans
    (cpu_decoder.py, made once per row count from each DecoderLayer.decode_on_kernels): the
    same hidden states, logits and cache writes as the layers' own forward, for 1, 3 and the
    most rows every linear of the model takes the kernels with (on AMX 341 for `small`: its
    dense down projection's k = 1,536), with dense and MoE layers in any order, the shared
    experts inside the call, with and without q_lora; a prefill step does not. With BLAS's
    sgemm found, the whole step (embedding, routers, final norm) is one C call, and
    `decode_logits` adds the LM head to it; without, the routers run in Python between the
    spans."""
    if not whole_step:
        monkeypatch.setattr(deepseek_v3, "blas_sgemm", lambda: None)
    elif cpu_decoder.blas_sgemm() is None:
        pytest.skip("torch has no MKL sgemm here")
    model = load_model(checkpoint(dtype="bfloat16", **config), "bfloat16")
    model.pack_for_cpu()
    bound = model._decode_on_kernels

    def fresh_cache(slots: int):
        cache = model.allocate_kv_cache(slots)
        return cache.copy_(torch.randn(cache.shape, generator=torch.Generator().manual_seed(2)))

    most = min(  # the most rows every linear of the model takes the kernels with
        matvec.linear_max_rows(m.in_features, m.kernel.fp8)
        for m in model.modules()
        if isinstance(m, Linear) and m.kernel is not None and m.weight.dim() == 2
    )
    for rows in (1, 3, most):
        results = []
        chunks = [SequenceChunk(torch.arange(b * 60, b * 60 + 40 + b), 1) for b in range(rows)]
        slots = rows * 61 + 40  # past every chunk's last slot
        meta = AttentionMetadata.build(chunks, "cpu", model.attention_layout)
        ids = torch.randint(0, 2048, (rows,), generator=torch.Generator().manual_seed(rows))
        for take in (True, False):
            model._decode_on_kernels = bound if take else (lambda *args: None)
            cache = fresh_cache(slots)
            with torch.inference_mode():
                hidden = model(ids, meta, cache)
                results.append((hidden, model.logits(hidden), cache))
        spans = model._kernel_spans[rows]
        assert spans is not None  # taken, with every layer bound
        assert spans.whole_step == whole_step  # embedding to final norm in one call
        for got, want in zip(results[0], results[1], strict=True):
            assert torch.equal(got, want)
        model._decode_on_kernels = bound
        cache = fresh_cache(slots)
        assert model.decode_logits(ids, meta, cache) is None  # outside inference mode
        with torch.inference_mode():
            logits = model.decode_logits(ids, meta, cache)
        assert (logits is not None) == whole_step
        if logits is not None:  # the same logits and cache writes in one call
            assert torch.equal(logits, results[1][1]) and torch.equal(cache, results[1][2])
    del model._decode_on_kernels  # the class's method again
    prefill = AttentionMetadata.build(
        [SequenceChunk(torch.arange(30), 30)], "cpu", model.attention_layout
    )
    with torch.inference_mode():
        model(torch.arange(30), prefill, model.allocate_kv_cache(64))
    assert 30 not in model._kernel_spans


@pytest.mark.skipif(matvec is None or not matvec.amx, reason="no AMX")
def test_prefill_sized_moe_on_amx_stays_with_the_grouped_path(checkpoint):
    """A chunk of tokens busy enough for the AMX experts: every element within a bf16 rounding
    of the grouped batched matmuls' result (most of them equal), at any row count (tiles of
    32 rows; an expert's last 16 rows or fewer on 16 rows' tiles; padded)."""
    model, moe = _packed_moe(checkpoint, "small")
    assert moe.experts.amx is not None
    g = torch.Generator().manual_seed(6)
    with torch.inference_mode():
        for t in (40, 129, 300):
            x = torch.randn(t, model.cfg.hidden_size, generator=g) * 2
            assert moe.bound_call(t) is not None
            amx = moe(x)
            grouped = _general_path(moe, x)
            scale = grouped.abs().max()
            assert (amx - grouped).abs().max() <= 2**-8 * scale
            assert (amx == grouped).float().mean() > 0.8
            gate_up = moe.experts.gate_up_proj.weight
            packed = matvec.amx_pack(gate_up)  # tile r of block (nb, kb): pairs of inputs
            tile = packed[0].flatten()[: 32 * 16].view(16, 16, 2)  # nb 0, kb 0
            assert torch.equal(tile[3, 5], gate_up[0, 5, 6:8])


@pytest.mark.skipif(matvec is None or not matvec.amx, reason="no AMX")
def test_shared_experts_past_their_kernels_bound_run_inside_the_call_on_amx(checkpoint):
    """A step past the shared experts' linears' bound on the kernels: the shared experts run
    inside the one call on the routed experts' AMX kernels, not on oneDNN after it; the block's
    output within a bf16 rounding of the shared experts run outside (nearly all equal), and
    equal to the same rows computed in a smaller step of the same path."""
    model, moe = _packed_moe(checkpoint, "small")
    assert moe.shared_amx is not None
    shared = moe.shared_experts
    rows = max(shared.gate_up_proj.kernel_rows, shared.down_proj.kernel_rows) + 88
    g = torch.Generator().manual_seed(13)
    x = torch.randn(rows, model.cfg.hidden_size, generator=g) * 2
    with torch.inference_mode():
        bound, whole = moe.bound_call(rows)
        assert whole
        assert bound.args["amx_s_gate_up"] is not None
        assert bound.args["w_s_gate_up"] is None
        inside = moe(x)
        packed, moe.shared_amx, moe._bound = moe.shared_amx, None, {}
        try:
            _, whole = moe.bound_call(rows)
            assert not whole  # the shared experts after the call
            outside = moe(x)
        finally:
            moe.shared_amx, moe._bound = packed, {}
        scale = outside.abs().max()
        assert (inside - outside).abs().max() <= 2**-8 * scale
        assert (inside == outside).float().mean() > 0.99
        tail = moe.bound_call(rows - 20)[0]  # still past the bound: the same path
        later = moe(x[20:])
        assert tail.args["amx_s_gate_up"] is not None
        assert torch.equal(later, inside[20:])  # a row's result, whatever the step


def _amx_experts_kernel(x: torch.Tensor, w: torch.Tensor, gated: bool = False) -> torch.Tensor:
    """x @ w^T through cpu_amx.c's expert kernel, which reads an `amx_pack`ed copy of w; with
    `gated`, w a gate_up weight, the SiLU-gated activations of it (its gated kernel)."""
    lib = ctypes.CDLL(str(build.built_library(matvec.isa)))  # the library `matvec` loaded
    run = lib.mci_amx_gated_experts_into if gated else lib.mci_amx_experts_into
    run.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p, cpu_kernels.Sink]
    run.argtypes += [ctypes.c_void_p] * 3 + [ctypes.c_long] * 3
    (m, k), n = x.shape, w.shape[0]
    width = n // 2 if gated else n
    packed, y = matvec.amx_pack(w[None], gated), torch.empty(m, width, dtype=torch.bfloat16)
    ids, starts, counts = torch.tensor([[0], [0], [m]])
    pointers = (ids.data_ptr(), starts.data_ptr(), counts.data_ptr())
    sink = cpu_kernels.Sink(y.data_ptr(), width)
    run(x.data_ptr(), k, packed.data_ptr(), sink, *pointers, 1, n, k)
    return y


@pytest.mark.skipif(matvec is None or not matvec.amx, reason="no AMX")
@pytest.mark.parametrize("k, n", [(512, 416), (256, 768), (128, 1024), (1536, 512)])
def test_linears_past_their_kernel_rows_run_on_the_packed_amx_kernel(k, n):
    """A bf16 linear of a weight up to AMX_PACKED_WEIGHT_BYTES, past its bound on the kernels
    and up to AMX_PACKED_MAX_ROWS rows: on the AMX expert kernel from its packed copy, the
    threads splitting the rows: the expert kernel's bits, within a bf16 step of the exact sum
    and of oneDNN's result (nearly all equal), each row's result whatever the rows beside it
    or the thread count; past AMX_PACKED_MAX_ROWS, and in batch invariance, oneDNN's."""
    g = torch.Generator().manual_seed(k + n)
    linear = Linear(k, (n,), torch.bfloat16)
    linear.weight.data.copy_(torch.randn(n, k, generator=g).to(torch.bfloat16))
    packed = linear.pack_for_cpu()
    assert packed and linear.amx_packed is not None
    rows = linear.kernel_rows + 150
    x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
    with torch.inference_mode():
        out = linear(x)
        ref = _reference(x, linear.weight)
        step = ref.float().abs().clamp(min=1e-3) * 2.0**-7
        assert ((out.float() - ref.float()).abs() <= step).all()
        onednn = packed_linear(x, linear._packed[0], None)
        assert ((out.float() - onednn.float()).abs() <= step).all()
        assert (out == onednn).float().mean() > 0.999
        assert torch.equal(out, _amx_experts_kernel(x, linear.weight))  # its bits
        part = linear(x[7 : 7 + linear.kernel_rows + 40])
        assert torch.equal(part, out[7 : 7 + linear.kernel_rows + 40])
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            alone = linear(x)
        finally:
            torch.set_num_threads(threads)
        assert torch.equal(alone, out)
        many = torch.randn(cpu_kernels.AMX_PACKED_MAX_ROWS + 1, k, generator=g).to(torch.bfloat16)
        assert torch.equal(linear(many), packed_linear(many, linear._packed[0], None))
        linear.set_batch_invariant(True)
        fixed = linear(x)
        assert torch.equal(fixed, packed_linear(x, linear._packed[0], BATCH_INVARIANT_ROWS))


@pytest.mark.skipif(matvec is None or not matvec.amx, reason="no AMX")
def test_gated_amx_experts_give_the_silu_gated_product_of_the_plain_kernels_outputs():
    """The gated expert kernel (gate and up packed interleaved, the activations stored straight
    from the tiles) against the plain kernel's gate and up outputs through torch's bf16 silu
    and mul: nearly every element equal (the exps differ within a float32 ulp), none more than
    a bf16 step apart; a row's result independent of the rows beside it; and bit for bit the
    C gated MLP's (plain outputs, then cpu_moe.c's silu_mul), both followed by one down."""
    g = torch.Generator().manual_seed(12)
    inter, k = 96, 160
    w = torch.randn(2 * inter, k, generator=g).to(torch.bfloat16)
    x = torch.randn(75, k, generator=g).to(torch.bfloat16)
    gate, up = _amx_experts_kernel(x, w).chunk(2, dim=-1)
    want = F.silu(gate) * up
    got = _amx_experts_kernel(x, w, gated=True)
    assert (got == want).float().mean() > 0.99
    step = want.float().abs().clamp(min=1e-3) * 2.0**-7
    assert ((got.float() - want.float()).abs() <= step).all()
    for rows in (40, 17, 16, 3):  # whole blocks, 32-row and 16-row tails
        assert torch.equal(_amx_experts_kernel(x[:rows], w, gated=True), got[:rows])
    # bit for bit cpu_moe.c's silu_mul of the plain outputs, seen through the gated MLP in one
    # call (its linears on the in-place AMX matmul: the expert kernel's sums), then down
    down = torch.randn(k, inter, generator=g).to(torch.bfloat16)  # back to the input width
    gate_up_weight, down_weight = cpu_kernels.KernelWeight(w), cpu_kernels.KernelWeight(down)
    gate_up_weight.set_amx_rows(2)
    down_weight.set_amx_rows(2)
    whole = matvec.gated_mlp(x, gate_up_weight, down_weight)
    assert torch.equal(whole, _amx_experts_kernel(got, down))


@pytest.mark.skipif(matvec is None or not matvec.amx, reason="no AMX")
@pytest.mark.parametrize(
    "k, n", [(512, 512), (256, 1280), (64, 37), (1536, 7), (32, 4), (1024, 96), (100, 37)]
)
def test_amx_rows_are_the_exact_sum_rounded_once_whatever_the_rows_and_threads(k, n):
    """A bf16 linear of AMX_ROWS rows or more on AMX tiles, the weight read in place: within a
    bf16 step of the exact sum (nearly always on it); a row's result never depends on the
    rows beside it, the thread count or the shares' edges, up to the kernels' most rows (512
    on AMX); equal to the AMX expert kernel on its packed copy; k not a multiple of 32 stays
    on the skinny kernels."""
    g = torch.Generator().manual_seed(k + n)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    x = torch.randn(matvec.linear_max_rows(k, fp8=False), k, generator=g).to(torch.bfloat16)
    weight = cpu_kernels.KernelWeight(w)
    weight.set_amx_rows(2)
    out = matvec.linear(x, weight)
    ref = _reference(x, w)
    ulp = ref.float().abs().clamp(min=1e-3) * 2.0**-7
    assert ((out.float() - ref.float()).abs() <= ulp).all()
    assert (out == ref).float().mean() > 0.99
    for rows in (2, 3, 16, 17, 33, 40, 300):
        for start in (0, 7 - rows % 7):
            assert torch.equal(
                matvec.linear(x[start : start + rows], weight), out[start : start + rows]
            )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert torch.equal(matvec.linear(x, weight), out)
    finally:
        torch.set_num_threads(threads)
    wide = torch.randn(5, 2 * k, generator=g).to(torch.bfloat16)[:, :k]  # row stride 2k
    assert torch.equal(matvec.linear(wide, weight), matvec.linear(wide.contiguous(), weight))
    skinny = matvec.linear(x, w)  # a plain tensor: amx_rows 0
    if k % 32:
        assert torch.equal(out, skinny)
    elif n % 32 == 0:  # whole blocks of 32 rows, and last blocks on 16 rows' tiles or 32
        for rows in (40, 16, 17, 3):
            assert torch.equal(out[:rows], _amx_experts_kernel(x[:rows], w))
    assert torch.equal(matvec.linear(x[:1], weight), skinny[:1])  # one row: the skinny kernel


@pytest.mark.skipif(matvec is None or not matvec.amx, reason="no AMX")
@pytest.mark.parametrize("n", [704, 200])
def test_amx_expert_rows_combine_as_the_weighted_index_add_bit_for_bit(n):
    """Routed experts of AMX_ROWS rows or more on AMX tiles too (each its expert's AMX
    result), one row on the skinny kernel, and the weighted sum as the MoE's index_add (also
    into a last block of fewer than 16 features: n = 200), whatever the thread count."""
    g = torch.Generator().manual_seed(9)
    w = torch.randn(3, n, 160, generator=g).to(torch.bfloat16)
    weight = cpu_kernels.KernelWeight(w)
    weight.set_amx_rows(2)
    x = torch.randn(59, 160, generator=g).to(torch.bfloat16)
    segments = torch.tensor([[2, 0, 1], [0, 40, 58], [40, 18, 1]])  # 40 rows, 18, then one
    tokens = torch.randint(0, 7, (59,), generator=g)
    weights = torch.rand(59, generator=g) * 2.5
    y = matvec.expert_linear(x, weight, segments)
    assert torch.equal(y[58:], matvec.linear(x[58:], w[1]))  # one row: the skinny kernel
    for rows, e in ((slice(0, 40), 2), (slice(40, 58), 0)):
        single = cpu_kernels.KernelWeight(w[e].contiguous())
        single.set_amx_rows(2)
        assert torch.equal(y[rows], matvec.linear(x[rows], single))
        if n % 32 == 0:
            assert torch.equal(y[rows], _amx_experts_kernel(x[rows], w[e]))
    expected = torch.zeros(7, n).index_add_(0, tokens, y.float() * weights[:, None])
    out = matvec.expert_linear_combine(x, weight, segments, tokens, weights, torch.zeros(7, n))
    assert torch.equal(out, expected)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        again = torch.zeros(7, n)
        matvec.expert_linear_combine(x, weight, segments, tokens, weights, again)
        assert torch.equal(matvec.expert_linear(x, weight, segments), y)
        assert torch.equal(again, out)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.skipif(matvec is None or not matvec.amx, reason="no AMX")
def test_a_model_runs_its_linears_on_amx_except_in_batch_invariance(checkpoint):
    model = load_model(checkpoint("tiny"), "bfloat16", "cpu")
    model.pack_for_cpu()

    def amx_rows() -> set[int]:
        return {m.kernel.struct.amx_rows for m in model.modules() if isinstance(m, Linear)}

    def absorbed() -> set[int]:  # the attention's per-head kernel weights
        with torch.inference_mode():
            heads = [a._absorb_weights(torch.bfloat16)[2:] for a in attentions]
        return {w.struct.amx_rows for pair in heads for w in pair}

    attentions = [m for m in model.modules() if hasattr(m, "_absorb_weights")]
    assert amx_rows() == absorbed() == {cpu_kernels.AMX_ROWS}
    model.set_batch_invariant(True)  # one kernel, oneDNN's, whatever the rows
    assert amx_rows() == absorbed() == {0}
    model.set_batch_invariant(False)
    assert amx_rows() == absorbed() == {cpu_kernels.AMX_ROWS}


def test_amx_turned_off_by_the_environment(monkeypatch, checkpoint):
    monkeypatch.setenv("MCI_CPU_AMX", "0")
    cpu_kernels.load.cache_clear()
    try:
        kernels = cpu_kernels.load()
        assert kernels is None or (not kernels.amx and kernels.amx_rows == 0)
        model = load_model(checkpoint("tiny"), "bfloat16", "cpu")
        model.pack_for_cpu()
        packed = [m.kernel for m in model.modules() if getattr(m, "kernel", None) is not None]
        assert all(k.struct.amx_rows == 0 for k in packed)
    finally:
        monkeypatch.delenv("MCI_CPU_AMX")
        cpu_kernels.load.cache_clear()


def test_turned_off_by_the_environment(monkeypatch):
    monkeypatch.setenv("MCI_CPU_MATVEC", "0")
    cpu_kernels.load.cache_clear()
    try:
        assert cpu_kernels.load() is None
    finally:
        monkeypatch.delenv("MCI_CPU_MATVEC")
        cpu_kernels.load.cache_clear()


@pytest.mark.skipif(" avx2" not in build.cpu_flags(), reason="the AVX2 build runs on AVX2 CPUs")
def test_avx2_build_compiles_and_its_prefill_attention_matches_softmax():
    """The AVX2 build (every CPU without AVX-512 loads it) compiles from the same sources,
    whose AVX-512 intrinsics cpu_avx2.h stands in for: a missing stand-in fails the whole
    build, and such CPUs then lose every kernel. Its prefill attention (masked rows, a tail
    not a multiple of 16) against float32 softmax attention."""
    lib = ctypes.CDLL(str(build.built_library("avx2")))
    kernels = cpu_kernels.CpuKernels(lib, "avx2", False, False)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 40, 96, generator=g).bfloat16()
    k = torch.randn(1, 2, 50, 96, generator=g).bfloat16()
    v = torch.randn(1, 2, 50, 64, generator=g).bfloat16()
    limits = torch.randint(1, 51, (1, 40), generator=g)
    out, lse = kernels.prefill_attention(q, k, v, limits, 0.1)
    scores = (q.float() @ k.float().transpose(-1, -2)) * 0.1
    seen = torch.arange(50)[None, :] < limits[0][:, None]
    scores = scores.masked_fill(~seen, float("-inf"))
    ref = torch.softmax(scores, -1) @ v.float()
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)  # P rounded to bf16
    torch.testing.assert_close(lse, torch.logsumexp(scores, -1), atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(cpu_decoder.blas_sgemm() is None, reason="torch has no MKL sgemm")
def test_the_routers_sgemm_gives_f_linears_bits():
    """cpu_decoder.c runs a router's float32 matmul through BLAS's sgemm as F.linear calls
    it: the same bits at every row count a step binds at and at DeepSeek-V3's router shape."""
    sgemm = cpu_decoder.blas_sgemm()
    gen = torch.Generator().manual_seed(0)
    for experts, hidden in ((32, 512), (256, 7168), (8, 96)):
        weight = torch.randn(experts, hidden, generator=gen) * 0.05
        for rows in (1, 2, 3, 7, 16, 33, 64, 300, 512):  # 512: cpu_kernels.AMX_MAX_ROWS
            assert cpu_decoder.sgemm_is_linear(sgemm, weight, rows)


@pytest.mark.parametrize("size", ["tiny", "small"])
@pytest.mark.parametrize("rows", [1, 3])
def test_several_greedy_decode_steps_in_one_call_are_those_steps_one_by_one(checkpoint, size, rows):
    """`decode_greedy` runs up to `steps` whole decode steps in one C call, each step's greedy
    tokens the next one's ids: the tokens are the first maxima of the logits `decode_logits`
    gives step by step, and the cache holds the same latents, bit for bit, at 1 and 3 rows.
    The call ends after a step that drew a stop id, once the wake-up descriptor is readable,
    or past its time budget; it refuses a slot table without room for the steps ahead."""
    model = load_model(checkpoint(dtype="bfloat16", size=size), "bfloat16")
    model.pack_for_cpu()
    steps = 6
    contexts = [torch.arange(b * 60, b * 60 + 40 + b) for b in range(rows)]
    ahead = [torch.arange(b * 60, b * 60 + 40 + b + steps - 1) for b in range(rows)]
    table = torch.nn.utils.rnn.pad_sequence(ahead, batch_first=True)
    ids = torch.randint(0, 2048, (rows,), generator=torch.Generator().manual_seed(rows))

    def fresh_cache():
        cache = model.allocate_kv_cache(rows * 61 + 60)
        noise = torch.randn(cache.shape, generator=torch.Generator().manual_seed(2))
        return cache.copy_(noise)

    def meta_at(k: int) -> AttentionMetadata:
        chunks = [SequenceChunk(a[: len(c) + k], 1) for a, c in zip(ahead, contexts)]
        return AttentionMetadata.build(chunks, "cpu", model.attention_layout)

    want, want_cache, step_ids = [], fresh_cache(), ids
    with torch.inference_mode():
        for k in range(steps):
            logits = model.decode_logits(step_ids, meta_at(k), want_cache)
            if logits is None:
                pytest.skip("no whole-step decoder here")
            step_ids = logits.argmax(-1)
            want.append(step_ids)
        want = torch.stack(want)
        cache = fresh_cache()
        got = model.decode_greedy(ids, meta_at(0), cache, table, steps)
        assert torch.equal(got, want) and torch.equal(cache, want_cache)
        # a stop id first drawn at a middle step ends the call after that step
        seen = [set(want[:k].flatten().tolist()) for k in range(steps)]
        stop = next(k for k in range(1, steps - 1) if int(want[k, 0]) not in seen[k])
        stop_ids = (int(want[stop, 0]), 999_999)
        got = model.decode_greedy(ids, meta_at(0), fresh_cache(), table, steps, stop_ids)
        assert torch.equal(got, want[: stop + 1])
        read, write = os.pipe()
        try:
            got = model.decode_greedy(ids, meta_at(0), fresh_cache(), table, steps, (), read)
            assert torch.equal(got, want)  # nothing to read: every step
            os.write(write, b"x")
            got = model.decode_greedy(ids, meta_at(0), fresh_cache(), table, steps, (), read)
            assert torch.equal(got, want[:1])  # readable: the step in flight only
        finally:
            os.close(read)
            os.close(write)
        # past its time budget after the first step: that step only
        got = model.decode_greedy(ids, meta_at(0), fresh_cache(), table, steps, (), None, 1e-9)
        assert torch.equal(got, want[:1])
        with pytest.raises(ValueError, match="no room"):
            model.decode_greedy(ids, meta_at(0), fresh_cache(), table[:, :-1], steps)


def test_a_whole_decode_step_waits_for_the_float32_precision_its_check_saw(checkpoint):
    """Routers run through sgemm only at the float32 matmul precision of their bit check:
    at another, F.linear may leave MKL, and the step goes back to torch's routers."""
    model = load_model(checkpoint(dtype="bfloat16", size="tiny"), "bfloat16")
    model.pack_for_cpu()
    meta = AttentionMetadata.build(
        [SequenceChunk(torch.arange(10), 1)], "cpu", model.attention_layout
    )
    with torch.inference_mode():
        model(torch.tensor([3]), meta, model.allocate_kv_cache(64))
    spans = model._kernel_spans[1]
    if not spans.whole_step:
        pytest.skip("no whole-step decoder here")
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("medium" if before != "medium" else "high")
        assert not spans.runs_whole()
    finally:
        torch.set_float32_matmul_precision(before)
    assert spans.runs_whole()


def test_a_whole_decode_step_refuses_an_id_outside_the_vocabulary(checkpoint):
    """An id past the embedding is an IndexError (as F.embedding's), not a read past it."""
    model = load_model(checkpoint(dtype="bfloat16", size="tiny"), "bfloat16")
    model.pack_for_cpu()
    meta = AttentionMetadata.build(
        [SequenceChunk(torch.arange(10), 1)], "cpu", model.attention_layout
    )
    cache = model.allocate_kv_cache(64)
    with torch.inference_mode():
        model(torch.tensor([3]), meta, cache)
        if not model._kernel_spans[1].whole_step:
            pytest.skip("no whole-step decoder here")
        with pytest.raises(IndexError):
            model(torch.tensor([model.cfg.vocab_size]), meta, cache)
