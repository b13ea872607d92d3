"""FP8 weights read in place by the CPU kernels (mci/kernels/cpu_fp8.c).

The reference is dequantise-then-multiply: the weight dequantised to bf16 (`dense_weight`),
then a bf16 matmul with float32 sums. The kernels' claims, tested at decode, expert and
prefill shapes:

* up to 16 rows (decode), and at every row count with `skinny_order` (batch invariance): bit
  for bit the bf16 skinny kernel's result on the dequantised weight (the same bf16 weights,
  the same float32 sums in the same order);
* more rows (prefill): the GEMM, whose sums run in another order: within float32 summation
  order of the exact product, |out - exact| <= half a bf16 ulp of the result (its one
  rounding) + k * 2^-23 * sum |x * w| (float32 sums of k terms in any order); and a row's
  result does not depend on the other rows of the call.
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import device_under_test, hf_greedy, load_hf_reference
from helpers import prefill_logits
from safetensors import safe_open
from safetensors.torch import save_file

from mci.kernels import cpu_kernels
from mci.layers.linear import Linear, quantize_fp8_blocks
from mci.models.loader import load_model
from mci.runner.single_sequence import decode_single_sequence

KERNELS = cpu_kernels.load()
needs_fp8_kernels = pytest.mark.skipif(
    KERNELS is None or not KERNELS.fp8, reason="the FP8 CPU kernels do not run on this machine"
)


def _fp8_linear(parts: tuple[int, ...], k: int, experts: int = 0, seed: int = 0) -> Linear:
    """A packed FP8 Linear whose parts are each quantised apart (as checkpoints store them)."""
    gen = torch.Generator().manual_seed(seed)
    layer = Linear(k, parts, torch.bfloat16, (128, 128), num_experts=experts)
    weights, scales = [], []
    for _ in range(max(experts, 1)):
        w = torch.randn(sum(parts), k, generator=gen) * 0.05
        qs, ss = zip(
            *(quantize_fp8_blocks(p, (128, 128)) for p in w.split(list(parts))), strict=True
        )
        weights.append(torch.cat(qs))
        scales.append(torch.cat(ss))
    layer.weight.data = torch.stack(weights) if experts else weights[0]
    layer.weight_scale_inv.data = torch.stack(scales) if experts else scales[0]
    assert layer.pack_for_cpu() and layer.kernel is not None and layer.kernel.fp8
    return layer


def _within_summation_order(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    exact = x.double() @ w.double().T
    magnitude = x.double().abs() @ w.double().abs().T
    ulp = torch.finfo(torch.bfloat16).eps * exact.abs().clamp(min=torch.finfo(torch.float32).tiny)
    bound = 0.5 * ulp + x.shape[1] * 2.0**-23 * magnitude
    assert ((out.double() - exact).abs() <= bound).all()


# (parts, in features): DeepSeek-like multiples of 128, parts that end inside a block
# (`small`'s fused [q | latent] projection), widths that are not multiples of 64 or of 128
SHAPES = [((512,), 1536), ((256, 160), 512), ((100, 37), 200), ((130,), 70), ((64,), 33)]


@needs_fp8_kernels
@pytest.mark.parametrize(("parts", "k"), SHAPES)
@pytest.mark.parametrize("rows", [1, 3, 4, 7, 16, 17, 100, 300])  # decode .. prefill
def test_fp8_linear_is_the_bf16_kernel_on_the_dequantised_weight(parts, k, rows):
    layer = _fp8_linear(parts, k)
    dense = layer.dense_weight(torch.bfloat16).contiguous()
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).bfloat16()
    out = layer(x)  # Linear.forward: the FP8 kernels at every row count
    _within_summation_order(out, x, dense)
    skinny = KERNELS.linear(x, dense)
    if rows <= KERNELS.fp8_skinny_rows:
        assert torch.equal(out, skinny)
        assert torch.equal(layer(x[-1:]), out[-1:])  # whatever else shares the call
    else:  # the GEMM: a row's result does not depend on the other rows either
        assert torch.equal(layer(torch.cat((x[-7:], x[:20])))[:7], out[-7:])
    layer.set_batch_invariant(True)  # the skinny kernels' order at every row count
    assert torch.equal(layer(x), skinny)
    assert torch.equal(layer(x[-1:]), skinny[-1:])


@needs_fp8_kernels
@pytest.mark.parametrize("rows_per_expert", [1, 4, 9, 40])
def test_fp8_experts_and_their_weighted_sum_equal_the_bf16_kernels(rows_per_expert):
    experts, hidden, inter = 6, 192, 160  # both dims end inside a 128-block
    gate_up = _fp8_linear((inter, inter), hidden, experts=experts, seed=1)
    down = _fp8_linear((hidden,), inter, experts=experts, seed=2)
    dense_gu = torch.stack([gate_up.dense_weight(torch.bfloat16, e) for e in range(experts)])
    dense_down = torch.stack([down.dense_weight(torch.bfloat16, e) for e in range(experts)])
    ids = [0, 2, 5]  # active experts, a few rows each
    counts = [rows_per_expert, rows_per_expert + 1, 2]
    starts = [0, counts[0], counts[0] + counts[1]]
    segments = torch.tensor([ids, starts, counts], dtype=torch.long)
    a = sum(counts)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(a, hidden, generator=gen).bfloat16()
    got = KERNELS.expert_linear(x, gate_up.kernel, segments)
    for e, s, c in zip(ids, starts, counts, strict=True):
        _within_summation_order(got[s : s + c], x[s : s + c], dense_gu[e])
    gate_up.set_batch_invariant(True)
    down.set_batch_invariant(True)  # bit for bit the skinny kernels at every count
    got = KERNELS.expert_linear(x, gate_up.kernel, segments)
    assert torch.equal(got, KERNELS.expert_linear(x, dense_gu.contiguous(), segments))
    act = torch.randn(a, inter, generator=gen).bfloat16()
    tokens = torch.randint(0, 5, (a,), generator=gen)
    weights = torch.rand(a, generator=gen)
    outs = [
        KERNELS.expert_linear_combine(act, w, segments, tokens, weights, torch.zeros(5, hidden))
        for w in (down.kernel, dense_down.contiguous())
    ]
    assert torch.equal(outs[0], outs[1])
    # one expert through Linear.forward, as the looped experts path calls it
    assert torch.equal(down(act, 5), KERNELS.linear(act, dense_down[5].contiguous()))


@needs_fp8_kernels
@pytest.mark.parametrize("fp8", [False, True])
def test_gemm_weighted_sum_is_the_index_add_bit_for_bit(fp8):
    """Busy experts on the GEMM (cpu_gemm.c: bf16 weights read in place, FP8 ones widened by
    cpu_fp8.c): each output row is within float32 summation order of the exact product, and
    the weighted sum the GEMM does as it writes (16 outputs at a time where a strip is whole,
    one at a time in a short one) equals torch's index_add over its bf16 rows exactly."""
    experts, hidden, inter = 6, 200, 160  # 100 outputs a thread: whole strips and a short one
    down = _fp8_linear((hidden,), inter, experts=experts, seed=2)
    dense = torch.stack([down.dense_weight(torch.bfloat16, e) for e in range(experts)])
    weight = down.kernel if fp8 else dense.contiguous()
    gemm_above = None if fp8 else 16  # FP8: past its own skinny bound (16 rows)
    counts = [40, 33, 17]
    segments = torch.tensor([[0, 2, 5], [0, 40, 73], counts], dtype=torch.long)
    gen = torch.Generator().manual_seed(9)
    act = torch.randn(sum(counts), inter, generator=gen).bfloat16()
    tokens = torch.randint(0, 7, (sum(counts),), generator=gen)
    weights = torch.rand(sum(counts), generator=gen) * 2.5
    y = KERNELS.expert_linear(act, weight, segments, gemm_above)
    for e, s, c in zip(*segments.tolist(), strict=True):
        _within_summation_order(y[s : s + c], act[s : s + c], dense[e])
    expected = torch.zeros(7, hidden).index_add_(0, tokens, y.float() * weights[:, None])
    out = KERNELS.expert_linear_combine(
        act, weight, segments, tokens, weights, torch.zeros(7, hidden), gemm_above
    )
    assert torch.equal(out, expected)
    skinny = KERNELS.expert_linear(act, dense.contiguous(), segments)  # another order
    assert not torch.equal(y, skinny)  # the GEMM ran: 3 of its 18,000 outputs differ here


def test_fp8_kernel_weight_checks_its_layout():
    with pytest.raises(ValueError, match="scale_inv"):
        cpu_kernels.KernelWeight(torch.zeros(4, 4, dtype=torch.float8_e4m3fn))
    with pytest.raises(ValueError, match="128x128"):
        cpu_kernels.KernelWeight(
            torch.zeros(4, 300, dtype=torch.float8_e4m3fn),
            torch.ones(1, 2),
            torch.zeros(4, dtype=torch.long),
        )


def _dequantised_checkpoint(fp8_path, out_path):
    """The FP8 checkpoint with every quantised weight dequantised to bf16 (its scales
    dropped): what a reference without FP8 support runs."""
    out_path.mkdir()
    tensors = {}
    with safe_open(fp8_path / "model.safetensors", framework="pt") as f:
        names = set(f.keys())
        for name in names:
            if name.endswith("_scale_inv"):
                continue
            t = f.get_tensor(name)
            scale_name = name + "_scale_inv"
            if scale_name in names:
                s = f.get_tensor(scale_name)
                full = s.repeat_interleave(128, 0)[: t.shape[0]]
                full = full.repeat_interleave(128, 1)[:, : t.shape[1]]
                t = (t.float() * full).bfloat16()
            tensors[name] = t.contiguous()
    save_file(tensors, out_path / "model.safetensors", metadata={"format": "pt"})
    for other in fp8_path.iterdir():
        if other.name == "config.json":
            cfg = json.loads(other.read_text())
            cfg.pop("quantization_config")
            (out_path / other.name).write_text(json.dumps(cfg))
        elif other.name != "model.safetensors":
            (out_path / other.name).write_bytes(other.read_bytes())
    return out_path


@pytest.fixture(scope="module")
def fp8_and_dequantised(checkpoint, tmp_path_factory):
    # hidden 192: projections that end inside a 128-block
    fp8 = checkpoint(dtype="bfloat16", fp8=True, seed=5, hidden_size=192, moe_intermediate_size=160)
    return fp8, _dequantised_checkpoint(fp8, tmp_path_factory.mktemp("fp8") / "dequantised")


def test_fp8_greedy_equals_transformers_on_the_dequantised_checkpoint(fp8_and_dequantised):
    fp8_path, plain_path = fp8_and_dequantised
    ours = load_model(fp8_path, "float32", str(device_under_test()))
    ref = load_hf_reference(plain_path)
    ids = torch.randint(0, 2048, (12,), generator=torch.Generator().manual_seed(4)).tolist()
    got = decode_single_sequence(ours, ids, max_new_tokens=24).token_ids
    assert got == hf_greedy(ref, ids, 24)


@needs_fp8_kernels
def test_fp8_on_the_kernels_is_bitwise_the_dequantised_bf16_model(fp8_and_dequantised):
    """Up to 16 rows both models run the skinny kernels on their linears (the bf16 one on the
    dequantised weights; AMX off for the linears' bf16 weights in both, which on AMX sum in
    AMX's order from 2 rows on; the absorbed per-head weights are bf16 in both, so whichever
    kernel runs them, it runs the same weights alike), so their logits agree bit for bit;
    beyond, the bf16 model's oneDNN matmuls sum in another order (within float32 summation
    order, as above)."""
    fp8_path, plain_path = fp8_and_dequantised
    fp8, plain = load_model(fp8_path, "bfloat16"), load_model(plain_path, "bfloat16")
    assert fp8.pack_for_cpu() and plain.pack_for_cpu()
    for module in (*fp8.modules(), *plain.modules()):
        if isinstance(module, Linear) and module.kernel is not None:
            module.kernel.set_amx_rows(0)
    ids = torch.randint(0, 2048, (12,), generator=torch.Generator().manual_seed(4)).tolist()
    assert torch.equal(prefill_logits(fp8, ids), prefill_logits(plain, ids))
    a = decode_single_sequence(fp8, ids, max_new_tokens=16)
    b = decode_single_sequence(plain, ids, max_new_tokens=16)
    assert a.token_ids == b.token_ids
    # and one byte per quantised parameter: no bf16 copy of an FP8 weight was made
    for module in fp8.modules():
        if isinstance(module, Linear) and module.block is not None:
            assert module.weight.dtype == torch.float8_e4m3fn and module._packed is None
