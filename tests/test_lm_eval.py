r"""lm-evaluation-harness scores a task through `mci serve` as transformers does (issue 8).

Usage: `make test-lm-eval` (installs the `lm-eval` extra if missing, then runs these tests), or by
hand against a running `mci serve`, from the repository root:
  lm_eval --model local-completions --include_path tests/data/lm_eval_task --tasks mci_python_mc \
    --model_args base_url=http://127.0.0.1:30000/v1/completions,model=default-model,\
tokenizer=mci/assets/default-model,tokenizer_backend=huggingface,tokenized_requests=True

lm-eval's `local-completions` scores a loglikelihood request by POSTing the token ids of
context + continuation with `echo: true, logprobs: 1, max_tokens: 1` and summing
`token_logprobs` over the continuation, so this needs mci's prompt logprobs under echo. The
reference is transformers' DeepseekV3ForCausalLM scoring the very token ids lm-eval sent: in
float32 it must agree exactly, in bf16 (as served) within bf16 drift, with fp32's accuracy.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch
from conftest import load_hf_reference
from server_helpers import LiveServer

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
MODEL = REPO / "mci" / "assets" / "default-model"
TASK_DIR = REPO / "tests" / "data" / "lm_eval_task"
TASK = "mci_python_mc"

# float32 leaves rounding nowhere to hide a scoring bug: measured, every log-likelihood through
# lm-eval + mci is within 8e-6 nats of transformers fp32's.
FP32_TOL = 1e-3
# bf16, as served. Measured on this task (42 items, 168 continuations of 1-7 tokens),
# transformers bf16 vs transformers fp32 -- the drift bf16 rounding alone causes (of activations,
# and of the logits themselves, whose step is 1/16-1/8 nat at their size) -- is up to 0.49 nats
# per continuation, 0.24 per token, 0.034 on average; mci bf16 vs transformers bf16 is up to 0.47,
# 0.05 on average, outside routing flips (below). The bound is ~1.5x what rounding moves the
# reference itself (which uses 0.65 of it) and far below what a scoring bug costs: the wrong
# position or token, or one dropped or added, moves a continuation by several nats.
TOL_PER_TOKEN = 0.25
TOL_BASE = 0.25
# Except where MoE routing flips: two experts within ~1e-3 of each other swap places under one
# rounding and not the other. Measured: at one position of one item the fp32 router margin is
# 2e-4, mci bf16 picks the other expert, and the choices scored through it move 0.9-1.7 nats.
# That is bf16, not either implementation (the fp32 test above is exact), so a couple of items
# may exceed the bound, by no more than a flip costs.
MAX_FLIP_ITEMS = 2
TOL_FLIP = 3.0
# A systematic error (a small shift on every token, e.g. a cached prefix scored slightly wrong)
# hides under the per-item bounds but not under the mean: ~3x the reference's own mean drift.
TOL_MEAN = 0.1
# Chance is 0.25; transformers fp32 gets ~0.9. A floor keeps the comparison from passing vacuously.
# The smallest fp32 margin between an item's top two choices is 2.8 nats, more than the largest
# drift measured (a routing flip included), so bf16 rounding does not flip an item's argmax.
MIN_ACCURACY = 0.5


def _model_args(url: str) -> str:
    return ",".join(
        [
            f"base_url={url}/v1/completions",
            "model=default-model",
            f"tokenizer={MODEL}",
            "tokenizer_backend=huggingface",
            "num_concurrent=1",
            "max_retries=1",
            "tokenized_requests=True",
        ]
    )


def _record_sent(monkeypatch) -> dict[tuple[str, str], tuple[list[int], int]]:
    """(context, continuation) -> (token ids lm-eval POSTed, context length it scores after).

    Recorded where lm-eval builds its request batch, so the reference scores exactly what was
    sent (lm-eval's own encode_pair split and any truncation), not a re-tokenisation of ours.
    """
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    sent: dict[tuple[str, str], tuple[list[int], int]] = {}
    build = LocalCompletionsAPI.batch_loglikelihood_requests

    def recording(self, chunks):
        inputs, ctxlens, keys = build(self, chunks)
        for ids, ctxlen, key in zip(inputs, ctxlens, keys, strict=True):
            sent[tuple(key)] = (list(ids), ctxlen)
        return inputs, ctxlens, keys

    monkeypatch.setattr(LocalCompletionsAPI, "batch_loglikelihood_requests", recording)
    return sent


def _require_prompt_logprobs(url: str) -> None:
    """Fail with one clear line, not lm-eval's KeyError, if echo does not score the prompt."""
    ids = [488, 291, 11, 91, 308]  # "def f(x):"
    body = {"model": "default-model", "prompt": ids, "max_tokens": 1, "echo": True, "logprobs": 1}
    lp = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["choices"][0]["logprobs"]
    got = lp["token_logprobs"] if lp else []
    assert len(got) == len(ids) + 1 and got[0] is None, (
        f"echo + logprobs must cover prompt and completion (null first): got {got}"
    )


_HF_CACHE: dict = {}


def _hf_logliks(dtype: torch.dtype, requests: list[tuple[list[int], int]]) -> list[float]:
    """Summed log-probability of ids[ctxlen:] given ids[:ctxlen], one forward per request.

    Cached: both tests score the same requests, and a bf16 forward is slow on CPU.
    """
    key = (dtype, repr(requests))
    if key not in _HF_CACHE:
        _HF_CACHE[key] = _score(load_hf_reference(MODEL, dtype), requests)
    return _HF_CACHE[key]


def _score(model, requests: list[tuple[list[int], int]]) -> list[float]:
    out = []
    with torch.no_grad():
        for ids, ctxlen in requests:
            logp = model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
            target = torch.tensor(ids[ctxlen:])
            out.append(logp[ctxlen - 1 : len(ids) - 1].gather(1, target[:, None]).sum().item())
    return out


def _accuracy(docs: list[tuple[int, int]], lls: list[float]) -> float:
    """lm-eval's `acc`: the choice with the largest summed log-likelihood (first on ties)."""
    right, i = 0, 0
    for gold, n in docs:
        scores = lls[i : i + n]
        right += max(range(n), key=lambda j: (scores[j], -j)) == gold
        i += n
    return right / len(docs)


@dataclass
class HarnessRun:
    """One lm-eval run through `mci serve`, flattened to one row per (item, choice)."""

    requests: list[tuple[list[int], int]]  # (token ids POSTed, context length), as lm-eval sent
    mci: list[float]  # the log-likelihood lm-eval read from mci's response
    docs: list[tuple[int, int]]  # per item: (gold choice, number of choices)
    acc: float  # lm-eval's own accuracy

    @property
    def n_cont(self) -> list[int]:
        return [len(ids) - ctxlen for ids, ctxlen in self.requests]


def _run_harness(monkeypatch, dtype: str) -> HarnessRun:
    # imported here, not at module level: the default (not slow) run never pays for lm-eval
    lm_eval = pytest.importorskip("lm_eval", reason="needs the lm-eval extra: make test-lm-eval")
    from lm_eval.tasks import TaskManager

    monkeypatch.chdir(REPO)  # the task's data_files path is relative to the repository root
    sent = _record_sent(monkeypatch)
    with LiveServer(None, "--dtype", dtype) as server:
        _require_prompt_logprobs(server.url)
        results = lm_eval.simple_evaluate(
            model="local-completions",
            model_args=_model_args(server.url),
            tasks=[TASK],
            task_manager=TaskManager(include_path=str(TASK_DIR)),
            log_samples=True,
            bootstrap_iters=0,
        )
    samples = sorted(results["samples"][TASK], key=lambda s: s["doc_id"])
    keys = [tuple(args) for s in samples for args in s["arguments"]]
    num_items = len((TASK_DIR / "python_mc.jsonl").read_text().splitlines())
    assert len(samples) == num_items and set(keys) == set(sent), "every choice scored, recorded"
    run = HarnessRun(
        requests=[sent[k] for k in keys],
        mci=[resp[0][0] for s in samples for resp in s["resps"]],
        docs=[(int(s["target"]), len(s["arguments"])) for s in samples],
        acc=results["results"][TASK]["acc,none"],
    )
    assert run.acc == pytest.approx(_accuracy(run.docs, run.mci))  # we read lm-eval's rule right
    return run


def test_lm_eval_fp32_is_transformers_fp32(monkeypatch):
    """In float32 rounding cannot hide a scoring bug: every log-likelihood is transformers'."""
    run = _run_harness(monkeypatch, "float32")
    hf32 = _hf_logliks(torch.float32, run.requests)
    d = [abs(a - b) for a, b in zip(run.mci, hf32)]
    print(f"\nfp32: acc mci {run.acc:.4f}  max |d loglik| mci vs hf-fp32 {max(d):.2e}")
    worst = max(range(len(d)), key=d.__getitem__)
    assert max(d) <= FP32_TOL, f"{run.requests[worst]}: mci {run.mci[worst]} hf {hf32[worst]}"
    assert run.acc == pytest.approx(_accuracy(run.docs, hf32))


def test_lm_eval_bf16_matches_transformers(monkeypatch):
    """As served (bf16): within bf16 drift of transformers bf16, and fp32's accuracy."""
    run = _run_harness(monkeypatch, "bfloat16")
    hf16 = _hf_logliks(torch.bfloat16, run.requests)
    hf32 = _hf_logliks(torch.float32, run.requests)
    acc16, acc32 = _accuracy(run.docs, hf16), _accuracy(run.docs, hf32)
    n_cont = run.n_cont
    d_mci = [abs(a - b) for a, b in zip(run.mci, hf16)]
    d_bf16 = [abs(a - b) for a, b in zip(hf16, hf32)]
    print(
        f"\nbf16: acc mci {run.acc:.4f}  hf-bf16 {acc16:.4f}  hf-fp32 {acc32:.4f}"
        f"\nmax |d loglik|: mci vs hf-bf16 {max(d_mci):.4f}  hf-bf16 vs hf-fp32 {max(d_bf16):.4f}"
        f"\nmax |d|/token:  mci vs hf-bf16 {max(d / n for d, n in zip(d_mci, n_cont)):.4f}"
        f"  hf-bf16 vs hf-fp32 {max(d / n for d, n in zip(d_bf16, n_cont)):.4f}"
        f"\nmean |d|:       mci vs hf-bf16 {sum(d_mci) / len(d_mci):.4f}"
        f"  hf-bf16 vs hf-fp32 {sum(d_bf16) / len(d_bf16):.4f}"
    )

    # (a) every choice's log-likelihood through lm-eval + mci is transformers bf16's, up to
    # rounding, with routing flips confined to a few items (counted per item: a flip at a
    # position in a shared context moves every choice that runs through it)
    off, i = {}, 0
    for item, (_, n) in enumerate(run.docs):
        for j in range(i, i + n):
            if d_mci[j] > TOL_PER_TOKEN * n_cont[j] + TOL_BASE:
                off.setdefault(item, []).append(
                    f"item {item} choice {j - i}: mci {run.mci[j]:.4f} hf-bf16 {hf16[j]:.4f}"
                    f" ({n_cont[j]} tokens)"
                )
        i += n
    report = "\n".join(line for lines in off.values() for line in lines)
    assert len(off) <= MAX_FLIP_ITEMS, f"{len(off)} items off:\n{report}"
    assert max(d_mci) <= TOL_FLIP, f"beyond a routing flip:\n{report}"
    assert sum(d_mci) / len(d_mci) <= TOL_MEAN, f"mean |d| {sum(d_mci) / len(d_mci):.4f}"
    # (b) the harness's accuracy through mci is transformers fp32's, and it means something
    assert run.acc == pytest.approx(acc32), f"mci {run.acc} vs transformers fp32 {acc32}"
    assert run.acc >= MIN_ACCURACY
