"""Batched sampler semantics: penalties, filters, seeds, logprobs."""

from __future__ import annotations

import pytest
import torch

from mci.core.request import Request
from mci.core.sampling_params import SamplingParams
from mci.errors import UserError
from mci.runner.sampler import _argmax, sample


def _req(params: SamplingParams, prompt=(1, 2, 3), output=()) -> Request:
    r = Request("x", list(prompt), params)
    for t in output:
        r.append_token(t)
    return r


def _draws(logits, req: Request, n: int) -> list[int]:
    """n tokens drawn one after another (each appended, as the engine does)."""
    out = []
    for _ in range(n):
        out.append(sample(logits, [req], ()).token_ids[0])
        req.append_token(out[-1])
    return out


def _logits(vocab=16, seed=0):
    return torch.randn(1, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_and_degenerate_filters_equal_argmax():
    logits = _logits()
    best = int(logits.argmax())
    for params in (
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.0, top_k=1),
        SamplingParams(temperature=1.0, top_p=1e-6),
        SamplingParams(temperature=1.0, min_p=1.0),
    ):
        assert sample(logits, [_req(params)], ()).token_ids == [best]


def test_repetition_penalty_matches_hf_rule():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    r = _req(SamplingParams(temperature=0, repetition_penalty=4.0), prompt=(0,), output=(1,))
    # token 0: 2.0 / 4 = 0.5; token 1: -2 * 4 = -8; token 2 untouched (1.0) wins
    assert sample(logits, [r], ()).token_ids == [2]


def test_frequency_and_presence_penalties():
    logits = torch.tensor([[3.0, 2.5, 0.0]])
    r = _req(
        SamplingParams(temperature=0, frequency_penalty=0.4, presence_penalty=0.5), output=(0, 0)
    )
    # token 0: 3.0 - 0.4*2 - 0.5 = 1.7 < 2.5
    assert sample(logits, [r], ()).token_ids == [1]


def test_min_new_tokens_masks_eos_and_stop_ids():
    logits = torch.tensor([[0.0, 9.0, 8.0, 1.0]])
    r = _req(SamplingParams(temperature=0, min_new_tokens=2, stop_token_ids=(2,)))
    assert sample(logits, [r], eos_ids=(1,)).token_ids == [3]


def test_seeded_draws_do_not_depend_on_batch_neighbours():
    logits = _logits(vocab=64, seed=3).repeat(3, 1)
    solo = [sample(logits[:1], [_req(SamplingParams(seed=7))], ()).token_ids[0] for _ in range(1)]
    reqs = [_req(SamplingParams(seed=1)), _req(SamplingParams(seed=7)), _req(SamplingParams())]
    draws = sample(logits, reqs, ()).token_ids
    assert draws[1] == solo[0]
    again = [_req(SamplingParams(seed=7)) for _ in range(2)]
    seq_a, seq_b = _draws(logits[:1], again[0], 20), _draws(logits[:1], again[1], 20)
    assert seq_a == seq_b and len(set(seq_a)) > 1


def test_a_draw_depends_on_the_seed_and_position_only():
    """Not on the draws before it: a request resumed elsewhere, or verifying several tokens at
    once, draws what a request sampled step by step would have."""
    logits = _logits(vocab=64, seed=4)
    stepwise = _draws(logits, _req(SamplingParams(seed=11)), 6)
    other_history = _req(SamplingParams(seed=11), output=(5, 9, 2, 2, 40))  # 5 tokens in
    assert sample(logits, [other_history], ()).token_ids[0] == stepwise[5]
    # each unseeded request has a random seed of its own (two streams agree on one draw here
    # with probability 0.47, on all 24 with ~1e-8: 6 draws failed about 1 run in 90)
    unseeded = [_draws(logits, _req(SamplingParams()), 24) for _ in range(2)]
    assert unseeded[0] != unseeded[1]


def test_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]]))
    r = _req(SamplingParams(seed=0))
    counts = torch.bincount(torch.tensor(_draws(logits, r, 3000)), minlength=3).float() / 3000
    assert torch.allclose(counts, torch.tensor([0.7, 0.2, 0.1]), atol=0.03)


def test_top_p_keeps_the_nucleus_only():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    r = _req(SamplingParams(top_p=0.8, seed=1))
    seen = set(_draws(logits, r, 300))
    assert seen == {0, 1}


def test_logprobs_are_of_the_raw_distribution():
    logits = _logits()
    r = _req(SamplingParams(temperature=0, logprobs=3, repetition_penalty=1.5))
    res = sample(logits, [r], ())
    lp, alts = res.logprobs[0]
    raw = torch.log_softmax(logits[0], -1)
    assert lp == pytest.approx(float(raw[res.token_ids[0]]))
    assert [a for a, _ in alts] == raw.topk(3).indices.tolist()


@pytest.mark.parametrize(
    "bad",
    [
        {"temperature": -1},
        {"top_p": 0},
        {"max_new_tokens": -1},  # 0 is valid: score the prompt only
        {"n": 0},
        {"logprobs": 50},
        {"stop": ["", "x"]},
    ],
)
def test_invalid_params_are_user_errors(bad):
    with pytest.raises(UserError):
        SamplingParams(**bad)


@pytest.mark.parametrize(
    "bad",
    [
        {"seed": 2**64},
        {"seed": -1},
        {"n": 10_000},
        {"stop_token_ids": ["x"]},
        {"stop_token_ids": [-3]},
    ],
)
def test_values_the_engine_cannot_take_are_rejected_up_front(bad):
    with pytest.raises(UserError):
        SamplingParams(**bad)


def test_the_greedy_argmax_picks_as_torch_does():
    """The sampler's argmax (numpy's on the CPU) picks torch.argmax's index: the first of tied
    maxima, a row's first NaN, the first of an all -inf row."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(300):
        v = torch.randn(4, 64, generator=gen)
        v[0, 9] = v[0, 40] = v[0].max() + 1  # a tie
        v[1, 13] = v[1, 50] = float("nan")
        v[2] = float("-inf")
        v[3, 5] = v[3, 6] = float("inf")
        assert torch.equal(_argmax(v), v.argmax(dim=-1))
