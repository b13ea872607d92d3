"""Prompt logprobs (scoring) and logit_bias in the engine.

Prompt logprobs come from the prefill forward: they must equal a plain full-sequence forward's
log-softmax whatever the chunking, prefix-cache state, preemption or batch, and a scoring-only
request (max_new_tokens = 0) must leave the KV pool as it found it.
"""

from __future__ import annotations

import pytest
import torch
from conftest import device_under_test, load_hf_reference
from engine_helpers import drive, greedy, make_scheduler

from mci.core.request import Request
from mci.core.sampling_params import SamplingParams
from mci.runner.sampler import SCORE_ROWS


@pytest.fixture(scope="module")
def setup(checkpoint):
    from mci.models.loader import load_model
    from mci.tokenizer import TextTokenizer

    path = checkpoint()
    return path, load_model(path, "float32", str(device_under_test())), TextTokenizer.load(path)


def _reference(path, ids: list[int], top: int):
    """transformers' log-softmax of each prompt token given its prefix, and top-k ids."""
    hf = load_hf_reference(path)
    with torch.no_grad():
        logits = hf(torch.tensor([ids], device=hf.device)).logits[0]
        lp = torch.log_softmax(logits.float(), -1).cpu()
    target = lp[:-1].gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)
    return target, lp[:-1].topk(top, dim=-1).indices


def _check(out, ids, ref_lp, ref_top, top):
    got = out.prompt_logprobs
    assert got is not None and len(got) == len(ids) and got[0] is None
    values = torch.tensor([lp for lp, _ in got[1:]])
    assert torch.allclose(values, ref_lp, atol=1e-4), (values - ref_lp).abs().max()
    for (_, alts), want in zip(got[1:], ref_top.tolist()):
        assert len(alts) == top
        # ties at fp32 precision may swap neighbours; the best alternative is unambiguous
        assert alts[0][0] == want[0]


@pytest.mark.parametrize(
    "sched",
    [
        {},
        {"chunked_prefill_size": 7},
        {"chunked_prefill_size": 5, "max_prefill_tokens": 9},
    ],
    ids=["whole", "chunk7", "chunk5-budget9"],
)
def test_prompt_logprobs_match_reference(setup, sched):
    path, model, tok = setup
    prompts = [tok.encode(t) for t in ["def fib(n):\n    return", "import os\nimport sys\n"]]
    prompts.append(list(prompts[0]))  # a repeat: its prefix is cached by then
    sch = make_scheduler(model, tok, path, **sched)
    reqs = [
        Request(f"r{i}", ids, greedy(0 if i == 1 else 3, prompt_logprobs=2))
        for i, ids in enumerate(prompts)
    ]
    finals = drive(sch, {0: reqs[:2], 4: reqs[2:]})
    for i, ids in enumerate(prompts):
        out = finals[f"r{i}"]
        ref_lp, ref_top = _reference(path, ids, 2)
        _check(out, ids, ref_lp, ref_top, 2)
        assert len(out.output_token_ids) == (0 if i == 1 else 3)
        assert out.finish_reason == "length"


def test_long_prompts_are_scored_in_slices(setup):
    """Prompts longer than SCORE_ROWS, two in one step: their logits are computed a slice at a
    time (a bounded buffer, mci/engine/memory_plan.py) and still match the reference."""
    path, model, tok = setup
    text = "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n" * 40
    ids = tok.encode(text)[: SCORE_ROWS + 50]
    other = tok.encode("import os\n" * 90)[: SCORE_ROWS + 7]
    assert len(ids) > SCORE_ROWS and len(other) > SCORE_ROWS
    sch = make_scheduler(model, tok, path, max_total_tokens=4096)
    rows_per_call: list[int] = []
    logits = model.logits

    def counted(hidden):
        rows_per_call.append(hidden.shape[0])
        return logits(hidden)

    model.logits = counted
    reqs = [
        Request("a", ids, greedy(2, prompt_logprobs=1)),
        Request("b", other, greedy(0, prompt_logprobs=1)),
    ]
    try:
        finals = drive(sch, {0: reqs})
    finally:
        del model.logits  # the class's method again
    assert max(rows_per_call) <= SCORE_ROWS  # never [prompt, vocab] at once
    assert sum(rows_per_call) >= len(ids) + len(other) - 2
    for name, prompt in (("a", ids), ("b", other)):
        ref_lp, ref_top = _reference(path, prompt, 1)
        _check(finals[name], prompt, ref_lp, ref_top, 1)


def test_scoring_survives_preemption_and_cache_hits(setup):
    """A tiny pool forces preemption mid-prompt; prompt logprobs are never duplicated or lost,
    and a prompt already in the prefix cache is recomputed rather than left unscored."""
    path, model, tok = setup
    ids = tok.encode("class Foo:\n    def __init__(self, x):\n        self.x = x\n")
    ref_lp, ref_top = _reference(path, ids, 1)
    sch = make_scheduler(model, tok, path, max_total_tokens=len(ids) + 30, chunked_prefill_size=8)
    warm = Request("warm", ids, greedy(2))
    drive(sch, {0: [warm]})
    hogs = [Request(f"hog{i}", ids[:10] + [i + 5], greedy(30)) for i in range(3)]
    scorer = Request("score", ids, greedy(4, prompt_logprobs=1))
    finals = drive(sch, {0: hogs, 1: [scorer]})
    assert sch.counters["preemptions"] > 0
    _check(finals["score"], ids, ref_lp, ref_top, 1)


def test_logit_bias_forces_and_bans(setup):
    path, model, tok = setup
    sch = make_scheduler(model, tok, path)
    ids = tok.encode("def main():")
    plain = drive(sch, {0: [Request("plain", ids, greedy(6))]})["plain"].output_token_ids
    forced_id = 7
    banned_id = plain[0]
    finals = drive(
        sch,
        {
            0: [
                Request("force", ids, greedy(6, logit_bias={forced_id: 100}, logprobs=0)),
                Request("ban", ids, greedy(6, logit_bias={banned_id: -100})),
            ]
        },
    )
    assert finals["force"].output_token_ids == [forced_id] * 6
    # logprobs stay the model's own (before the bias), as OpenAI and vLLM report them
    assert all(lp < 0 for lp, _ in finals["force"].logprobs)
    assert banned_id not in finals["ban"].output_token_ids


def test_sampling_params_reject_bad_bias():
    with pytest.raises(Exception, match="logit_bias"):
        SamplingParams(logit_bias={1: 101})
    with pytest.raises(Exception, match="logit_bias"):
        SamplingParams(logit_bias={-1: 1})
