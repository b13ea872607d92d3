"""DeepSeekMoE routing and batched experts against a plain per-token reference."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mci.models.loader import load_model


def _naive_moe(moe, x):
    """Route each token on its own (group-limited top-k) and sum its experts' outputs."""
    gate = moe.gate
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        scores = torch.sigmoid(x[t].float() @ gate.weight.T)
        choice = scores + gate.e_score_correction_bias
        groups = choice.view(gate.n_group, -1)
        group_score = groups.topk(2).values.sum(-1)
        kept = set(group_score.topk(gate.topk_group).indices.tolist())
        per_group = groups.shape[1]
        allowed = [e for e in range(gate.num_experts) if e // per_group in kept]
        chosen = sorted(allowed, key=lambda e: -choice[e].item())[: gate.top_k]
        w = scores[chosen]
        w = w / w.sum() * gate.scaling if gate.norm_topk_prob else w * gate.scaling
        for weight, e in zip(w, chosen):
            w_gate, w_up = moe.experts.gate_up_proj.weight[e].chunk(2, dim=0)
            h = F.silu(x[t] @ w_gate.T) * (x[t] @ w_up.T)
            out[t] += weight * (h @ moe.experts.down_proj.weight[e].T)
        out[t] += moe.shared_experts(x[t : t + 1])[0]
    return out


def test_batched_moe_equals_per_token_reference(checkpoint):
    model = load_model(checkpoint(bias_std=0.5), "float32")
    moe = model.model.layers[1].mlp
    x = torch.randn(37, model.cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(moe(x), _naive_moe(moe, x), rtol=1e-5, atol=1e-5)


def test_group_limit_restricts_experts_to_top_groups(checkpoint):
    model = load_model(checkpoint(bias_std=0.5), "float32")
    gate = model.model.layers[1].mlp.gate
    x = torch.randn(200, model.cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    _, ids = gate(x)
    per_group = gate.num_experts // gate.n_group
    groups_used = [len(set((row // per_group).tolist())) for row in ids]
    assert max(groups_used) <= gate.topk_group


def _both_expert_paths(experts, x, weights, ids):
    """The routed experts' output through the grouped path and through the looped one."""

    def not_looped(*args):
        raise AssertionError("the grouped path was expected")

    experts._looped = not_looped
    try:
        grouped = experts(x, weights, ids)
    finally:
        del experts._looped
    saved = experts.GROUPED_MIN_ACTIVE
    experts.GROUPED_MIN_ACTIVE = 2.0  # more than every expert: always loop
    try:
        looped = experts(x, weights, ids)
    finally:
        experts.GROUPED_MIN_ACTIVE = saved
    return grouped, looped


def test_grouped_and_looped_experts_agree_bitwise(checkpoint):
    """A token's expert output must not depend on which path its step took (batched = solo)."""
    for dtype, pack in (("bfloat16", True), ("bfloat16", False)):  # float32 always loops
        model = load_model(checkpoint(dtype="bfloat16"), dtype)
        if pack:
            model.pack_for_cpu(skinny_kernels=False)  # the two oneDNN paths
        moe = model.model.layers[1].mlp
        for tokens in (24, 40):  # every expert active, few tokens each: grouped
            x = torch.randn(
                tokens, model.cfg.hidden_size, generator=torch.Generator().manual_seed(2)
            )
            weights, ids = moe.gate(x)
            assert ids.unique().numel() == moe.gate.num_experts
            grouped, looped = _both_expert_paths(moe.experts, x.to(model.dtype), weights, ids)
            assert torch.equal(grouped, looped), (dtype, pack, tokens)
