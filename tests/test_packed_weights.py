"""oneDNN-packed weights (the CPU engine's matmuls) give bitwise the same logits as aten's
(the skinny-row kernels are another kernel: tests/test_cpu_kernels.py)."""

from __future__ import annotations

import torch
from helpers import needs_bf16_matmuls, prefill_logits, stepwise_logits

from mci.models.loader import load_model


@needs_bf16_matmuls
def test_packed_model_gives_identical_logits(checkpoint):
    model = load_model(checkpoint(dtype="bfloat16"), "bfloat16")
    ids = torch.randint(0, 2048, (37,), generator=torch.Generator().manual_seed(3)).tolist()
    plain = prefill_logits(model, ids), stepwise_logits(model, ids[:12], "auto", first_chunk=5)
    assert model.pack_for_cpu(skinny_kernels=False) > 0
    packed = prefill_logits(model, ids), stepwise_logits(model, ids[:12], "auto", first_chunk=5)
    for a, b in zip(plain, packed, strict=True):
        assert torch.equal(a, b)


def test_float32_float16_and_fp8_weights_are_never_packed(checkpoint):
    assert load_model(checkpoint(), "float32").pack_for_cpu() == 0
    assert load_model(checkpoint(dtype="bfloat16"), "float16").pack_for_cpu() == 0
    model = load_model(checkpoint(fp8=True, dtype="bfloat16"), "bfloat16")
    model.pack_for_cpu()
    assert all(
        m._packed is None
        for m in model.modules()
        if hasattr(m, "weight_scale_inv")  # FP8 linears keep one byte per parameter
    )


def test_bucket_rows_bounds_the_shapes_and_the_padding():
    from mci.layers.linear import bucket_rows

    buckets = {bucket_rows(m) for m in range(1, 8193)}
    assert len(buckets) <= 72  # oneDNN compiles one kernel per shape: keep them few
    for m in range(1, 8193):
        b = bucket_rows(m)
        assert m <= b and bucket_rows(b) == b
        assert b == m if m <= 16 else b - m < 16 if m <= 256 else b <= m * 1.125


@needs_bf16_matmuls
def test_padded_rows_do_not_change_the_rows_kept():
    from mci.layers.linear import Linear

    torch.manual_seed(0)
    layer = Linear(512, (384, 32), torch.bfloat16)
    layer.weight.data.normal_()
    x = torch.randn(700, 512, dtype=torch.bfloat16)
    assert layer.pack_for_cpu(skinny_kernels=False)  # oneDNN at every row count

    def unpadded(rows):
        return torch.ops.mkldnn._linear_pointwise(x[:rows], layer._packed[0], None, "none", [], "")

    for rows in (1, 5, 17, 100, 257, 700):  # exact, and padded in every bucket range
        assert torch.equal(layer(x[:rows]), unpadded(rows))
    assert torch.equal(layer(x[:60].view(3, 20, 512)), unpadded(60).view(3, 20, -1))


@needs_bf16_matmuls
def test_kernel_warm_up_runs_every_bucketed_shape_once(checkpoint):
    """Every packed weight shape at every bucketed row count oneDNN takes (not the skinny
    kernels', nor on AMX the packed copy's), the vocabulary head up to the logit rows, the
    absorbed attention's two per-head matmuls at every bucketed count, the grouped experts'
    two at every bucketed capacity up to their bound; and it leaves the model's outputs
    alone."""
    from mci.kernels.cpu_kernels import AMX_PACKED_MAX_ROWS
    from mci.layers.linear import Linear, bucket_sizes
    from mci.layers.moe import RoutedExperts

    model = load_model(checkpoint(dtype="bfloat16"), "bfloat16")
    model.pack_for_cpu()
    ids = torch.randint(0, 2048, (20,), generator=torch.Generator().manual_seed(4)).tolist()
    before = prefill_logits(model, ids)
    head = model.lm_head
    first = {}  # each weight shape's first packed layer (kernels are keyed by shape)
    for m in model.modules():
        if isinstance(m, Linear) and m._packed is not None:
            first.setdefault((m.out_features, m.in_features), m)
    del first[head.out_features, head.in_features]  # heads (MTP's too): the logit rows
    sizes = bucket_sizes(300)
    assert sizes[:17] == list(range(1, 17)) + [32] and sizes[-1] == 320

    def onednn(layer, n):  # the row counts oneDNN takes for this layer: not the kernels'
        amx = layer.amx_packed is not None  # on AMX, up to AMX_PACKED_MAX_ROWS from a copy
        return [
            rows
            for rows in bucket_sizes(n)
            if layer.skinny(rows) is None and not (amx and rows <= AMX_PACKED_MAX_ROWS)
        ]

    most = AMX_PACKED_MAX_ROWS + 200  # past the kernels' most rows, on AMX too
    assert all(0 < len(onednn(layer, most)) < len(bucket_sizes(most)) for layer in first.values())
    capacities = bucket_sizes(RoutedExperts.GROUPED_MAX_ROWS)
    expected = len(onednn(head, 40)) + sum(len(onednn(layer, most)) for layer in first.values())
    expected += 2 * len(bucket_sizes(most)) + 2 * len(capacities)
    assert model.warm_up_cpu_kernels(most, 40) == expected
    assert torch.equal(prefill_logits(model, ids), before)


def test_widened_bf16_matmuls_round_once_from_the_exact_products(monkeypatch):
    """Where oneDNN runs no bf16 matmuls (forced here: an AVX2 CPU), a bf16 Linear keeps a
    float32 copy of its weight, and calls of WIDENED_MIN_ROWS rows or more are float32 sums of
    the exact bf16 products rounded once: within a bf16 ulp of the float64 product (equal to
    its rounding but for near-ties), the weight itself untouched. Fewer rows stay on torch's
    bf16 kernel."""
    import torch.nn.functional as F

    import mci.layers.linear as linear

    monkeypatch.setattr(linear, "bf16_matmuls_supported", lambda: False)
    torch.manual_seed(0)
    layer = linear.Linear(512, (384, 32), torch.bfloat16)
    layer.weight.data.normal_()
    weight = layer.weight.detach().clone()
    assert layer.pack_for_cpu() and layer._packed is None and layer.widened is not None
    assert layer.widened.dtype == torch.float32 and torch.equal(layer.widened.bfloat16(), weight)
    x = torch.randn(40, 512).bfloat16()
    got = layer(x)
    exact = x.double() @ weight.double().T
    _, exponent = torch.frexp(exact)
    ulp = torch.ldexp(torch.ones_like(exact), exponent - 8)  # bf16 keeps 8 significant bits
    assert got.dtype == torch.bfloat16
    assert ((got.double() - exact).abs() <= ulp).all()
    assert (got == exact.bfloat16()).float().mean() > 0.999
    assert torch.equal(layer(x[:10].view(2, 5, 512)), got[:10].view(2, 5, -1))
    few = x[: linear.WIDENED_MIN_ROWS - 1]
    assert torch.equal(layer(few), F.linear(few, weight))


@needs_bf16_matmuls
def test_rows_a_producer_left_room_for_are_read_in_place_whatever_they_hold():
    """An activation made by `empty_rows` (a norm's output, silu * up, a cast) reaches the
    packed matmul at its bucketed row count without a copy: `pad_rows` views the rows after
    it in its own storage. Whatever those rows hold (here NaN and infinity) reaches only
    their own results, which are dropped: the rows kept are the zero-padded call's bits."""
    from mci.layers.linear import Linear, empty_rows, pad_rows

    torch.manual_seed(1)
    layer = Linear(512, (384,), torch.bfloat16)
    layer.weight.data.normal_()
    assert layer.pack_for_cpu(skinny_kernels=False)
    for rows in (17, 300, 1056):
        x = empty_rows(rows, 512, dtype=torch.bfloat16)
        x.copy_(torch.randn(rows, 512))
        room = x.untyped_storage().nbytes() // 1024 - rows  # rows of 512 bf16 after x
        tail = x.as_strided((room, 512), (512, 1), rows * 512)
        tail[::2] = float("nan")
        tail[1::2] = float("inf")
        padded = pad_rows(x)
        assert padded.data_ptr() == x.data_ptr() and padded.shape[0] > rows  # a view, no copy
        zero_padded = torch.cat((x, x.new_zeros((padded.shape[0] - rows, 512))))
        assert torch.equal(layer(x), layer(zero_padded)[:rows])
    plain = torch.randn(300, 512, dtype=torch.bfloat16)  # no room: zero rows appended, a copy
    assert pad_rows(plain).data_ptr() != plain.data_ptr()
    assert not pad_rows(plain)[300:].any()
