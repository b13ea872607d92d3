"""mci's DeepSeek-V3 equals transformers' DeepseekV3ForCausalLM (fp32, seeded tiny configs)."""

from __future__ import annotations

import pytest
import torch
from conftest import device_under_test, hf_greedy, load_hf_reference
from helpers import prefill_logits

from mci.models.loader import load_model
from mci.runner.single_sequence import decode_single_sequence
from mci.tools.make_checkpoint import YARN_EXAMPLE

LOGIT_TOL = 1e-4
PROMPT_LENGTHS = (1, 7, 33)

VARIANTS = {
    "default": {},
    "yarn": {"rope": YARN_EXAMPLE},
    "q_lora_none": {"q_lora_rank": None},
    "all_moe": {"first_k_dense_replace": 0},
    "one_dense": {"first_k_dense_replace": 1, "num_hidden_layers": 3},
    "all_dense": {"first_k_dense_replace": 2},
    "no_norm_topk": {"norm_topk_prob": False},
    "strong_bias": {"bias_std": 2.0},
    "rope_not_interleaved": {"rope_interleave": False},
}


def _prompt(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_reference(checkpoint, variant):
    path = checkpoint(**VARIANTS[variant])
    device = device_under_test()
    ours, ref = load_model(path, "float32", str(device)), load_hf_reference(path)
    for n in PROMPT_LENGTHS:
        ids = _prompt(n, ours.cfg.vocab_size, seed=n)
        with torch.no_grad():
            expected = ref(torch.tensor([ids], device=device)).logits[0].cpu()
        for path_name in ("expanded", "absorbed"):
            got = prefill_logits(ours, ids, path_name)
            diff = (got - expected).abs().max().item()
            assert diff <= LOGIT_TOL, f"{variant} n={n} {path_name}: max |diff| {diff:.2e}"


def test_bias_changes_routing_but_not_weights(checkpoint):
    """The strong-bias variant must really route differently than without the bias."""
    model = load_model(checkpoint(bias_std=2.0), "float32")
    router = model.model.layers[1].mlp.gate
    x = torch.randn(64, model.cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    with_bias_w, with_bias_ids = router(x)
    bias = router.e_score_correction_bias.clone()
    router.e_score_correction_bias.zero_()
    _, no_bias_ids = router(x)
    router.e_score_correction_bias.copy_(bias)
    assert not torch.equal(with_bias_ids.sort(-1).values, no_bias_ids.sort(-1).values)
    # weights come from the un-biased sigmoid scores of the chosen experts
    scores = torch.sigmoid(x @ router.weight.T).gather(1, with_bias_ids)
    expected = scores / scores.sum(-1, keepdim=True) * model.cfg.routed_scaling_factor
    torch.testing.assert_close(with_bias_w, expected)


@pytest.mark.parametrize("variant", ["default", "yarn", "q_lora_none", "strong_bias"])
def test_greedy_continuation_matches_reference(checkpoint, variant):
    path = checkpoint(**VARIANTS[variant])
    ours = load_model(path, "float32", str(device_under_test()))
    ref = load_hf_reference(path)
    ids = _prompt(12, ours.cfg.vocab_size, seed=99)
    got = decode_single_sequence(ours, ids, max_new_tokens=32).token_ids
    assert got == hf_greedy(ref, ids, 32)
