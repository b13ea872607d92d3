"""Deterministic (batch-invariant) inference: bf16 logits and outputs bit-identical whatever the
batch, the chunking, the prefix cache or preemption (`--deterministic`), with bf16 or FP8
weights."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from engine_helpers import drive
from helpers import needs_bf16_matmuls

from mci.cache.config import CacheConfig
from mci.core.request import Request
from mci.core.sampling_params import SamplingParams
from mci.engine.builder import build_engine_core
from mci.engine.config import EngineConfig, ModelPlacement
from mci.errors import UserError
from mci.layers.attention_metadata import AttentionMetadata, SequenceChunk
from mci.layers.linear import bf16_matmuls_supported
from mci.models.loader import load_model
from mci.scheduler.config import SchedulerConfig
from mci.tokenizer import TextTokenizer


@pytest.fixture(scope="module", params=["bf16", "fp8"])
def bf16(checkpoint, request):
    if not bf16_matmuls_supported():
        pytest.skip("this CPU runs no oneDNN bf16 matmuls (--deterministic needs them)")
    """A bf16 model in batch-invariant mode (its own object: the mode belongs to the model),
    with bf16 weights or FP8 ones (on the CPU kernels: one order of sums at every row count)."""
    path = checkpoint(dtype="bfloat16", fp8=request.param == "fp8")
    model = load_model(path, "bfloat16")
    model.set_batch_invariant(True)
    return path, model


def _target_logits(model, schedule, seqs) -> torch.Tensor:
    """Run `schedule` (steps of (sequence, new tokens)); sequence 0's logits, in order."""
    cache = model.allocate_kv_cache(600 * len(seqs))
    done = [0] * len(seqs)
    rows = []
    for step in schedule:
        chunks, ids, mine, offset = [], [], None, 0
        for k, n in step:
            length = done[k] + n
            chunks.append(SequenceChunk(torch.arange(600 * k, 600 * k + length), n))
            ids += seqs[k][done[k] : length]
            if k == 0:
                mine = slice(offset, offset + n)
            offset, done[k] = offset + n, length
        meta = AttentionMetadata.build(chunks, "cpu", model.attention_layout)
        logits = model.logits(model(torch.tensor(ids), meta, cache))
        if mine is not None:
            rows.append(logits[mine])
    return torch.cat(rows)


def test_logits_do_not_depend_on_batch_chunking_or_step_shape(bf16):
    _, model = bf16
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, 2000, (n,), generator=gen).tolist() for n in (70, 90, 140, 9, 230)]
    whole = _target_logits(model, [[(0, 70)]], seqs)
    schedules = {
        "7-token chunks": [[(0, min(7, 70 - i))] for i in range(0, 70, 7)],
        # a 30-token continuation as one forward (whole) vs 30 one-token steps
        "prefill then decode": [[(0, 40)]] + [[(0, 1)]] * 30,
        "beside other prefills": [[(1, 5), (0, 70), (2, 33), (3, 9)]],
        "decoding in a batch": [[(0, 40), (1, 50), (2, 100), (4, 150)]]
        + [[(4, 1), (0, 1), (1, 1), (2, 1)]] * 30,
        "mixed steps": [[(0, 20), (1, 5)]] + [[(0, 1), (1, 1), (2, 3)]] * 25 + [[(4, 64), (0, 25)]],
    }
    for name, schedule in schedules.items():
        assert torch.equal(_target_logits(model, schedule, seqs), whole), name


def test_chunked_prompts_equal_whole_ones(bf16):
    """Prompts of the served test below, each in 7-token chunks vs whole. On an AMD EPYC
    (avx512_bf16, no AMX), SDPA over padded keys rounded one row of prompt 27 differently with
    the chunk's query count; with the CPU kernels every row now attends alone."""
    _, model = bf16
    for i, prompt in enumerate(_served_prompts()):
        whole = _target_logits(model, [[(0, len(prompt))]], [prompt])
        chunks = [[(0, min(7, len(prompt) - s))] for s in range(0, len(prompt), 7)]
        assert torch.equal(_target_logits(model, chunks, [prompt]), whole), i


def _served_prompts() -> list[list[int]]:
    """32 prompts of 4-39 tokens, every fourth after a shared 20-token prefix."""
    gen = torch.Generator().manual_seed(5)
    shared = torch.randint(3, 2000, (20,), generator=gen).tolist()
    return [
        (shared if i % 4 == 0 else [])
        + torch.randint(
            3, 2000, (int(torch.randint(4, 40, (1,), generator=gen)),), generator=gen
        ).tolist()
        for i in range(32)
    ]


def _requests(tag: str) -> list[Request]:
    """32 requests: mixed lengths, 8 sharing a 24-token prefix, a third sampled with a seed,
    every one with logprobs."""
    gen = torch.Generator().manual_seed(1)
    shared = torch.randint(3, 2000, (24,), generator=gen).tolist()
    reqs = []
    for i in range(32):
        n = int(torch.randint(4, 60, (1,), generator=gen))
        prompt = torch.randint(3, 2000, (n,), generator=gen).tolist()
        if i % 4 == 0:
            prompt = shared + prompt[:8]
        sampled = i % 3 == 0
        params = SamplingParams(
            max_new_tokens=10,
            temperature=0.9 if sampled else 0.0,
            seed=100 + i if sampled else None,
            ignore_eos=True,
            logprobs=2,
        )
        reqs.append(Request(f"{tag}{i}", prompt, params))
    return reqs


def _core(model, path, max_total_tokens=8192, **sched):
    config = EngineConfig(
        model=ModelPlacement(
            model_path=path, dtype="bfloat16", deterministic=True, skip_kernel_warmup=True
        ),
        cache=CacheConfig(max_total_tokens=max_total_tokens),
        scheduler=dataclasses.replace(SchedulerConfig(), **sched),
        check_integrity=True,
    )
    return build_engine_core(config, model, TextTokenizer.load(path))


def _results(finals: dict, tag: str) -> list:
    return [(finals[f"{tag}{i}"].output_token_ids, finals[f"{tag}{i}"].logprobs) for i in range(32)]


def test_outputs_identical_together_alone_and_chunked_with_preemption(bf16):
    path, model = bf16
    together = _results(drive(_core(model, path), {0: _requests("a")}), "a")

    alone_core, alone = _core(model, path), {}
    for req in _requests("b"):  # one at a time; later ones hit the radix cache
        alone.update(drive(alone_core, {0: [req]}))
    assert alone_core.counters["prefix_cache_hits"] > 0

    tight = _core(model, path, max_total_tokens=400, chunked_prefill_size=7)
    arrivals: dict[int, list[Request]] = {}
    for i, req in enumerate(_requests("c")):
        arrivals.setdefault(i // 3, []).append(req)
    chunked = _results(drive(tight, arrivals), "c")
    assert tight.counters["preemptions"] > 0

    assert _results(alone, "b") == together
    assert chunked == together


def test_deterministic_needs_bf16_on_the_cpu(checkpoint):
    path = checkpoint()  # float32
    config = EngineConfig(
        model=ModelPlacement(
            model_path=path, dtype="float32", deterministic=True, skip_kernel_warmup=True
        )
    )
    with pytest.raises(UserError, match="deterministic"):
        build_engine_core(config, load_model(path, "float32"), TextTokenizer.load(path))


def test_sglang_flag_spelling_is_accepted():
    import argparse

    from mci.engine.config import add_engine_flags, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    for flag in ("--deterministic", "--enable-deterministic-inference"):
        assert engine_config_from_args(parser.parse_args([flag])).model.deterministic
    assert not engine_config_from_args(parser.parse_args([])).model.deterministic


def _served_outputs(server, prompts, concurrent: bool) -> list:
    """Token ids' text and logprobs of each prompt through `/v1/completions`."""
    from concurrent.futures import ThreadPoolExecutor

    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)

    def complete(i: int):
        sampled = i % 3 == 0
        out = client.completions.create(
            model="m",
            prompt=prompts[i],
            max_tokens=8,
            temperature=0.9 if sampled else 0.0,
            seed=7 + i if sampled else None,
            logprobs=2,
            extra_body={"ignore_eos": True},
        ).choices[0]
        lp = out.logprobs
        return out.text, lp.tokens, lp.token_logprobs, lp.top_logprobs

    if not concurrent:
        return [complete(i) for i in range(len(prompts))]
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(complete, range(len(prompts))))


@needs_bf16_matmuls
def test_served_outputs_identical_across_schedules(checkpoint):
    from server_helpers import LiveServer

    path = checkpoint(dtype="bfloat16")
    prompts = _served_prompts()
    name = ("--served-model-name", "m", "--deterministic")
    with LiveServer(path, *name, "--max-total-tokens", "4096", dtype="bfloat16") as server:
        together = _served_outputs(server, prompts, concurrent=True)
        alone = _served_outputs(server, prompts, concurrent=False)
    tight = ("--chunked-prefill-size", "7", "--max-total-tokens", "160")
    with LiveServer(
        path, *name, *tight, "--enable-deterministic-inference", dtype="bfloat16"
    ) as server:
        squeezed = _served_outputs(server, prompts, concurrent=True)
        counters = server.state()["counters"]
    assert counters.get("preemptions", 0) > 0
    assert alone == together
    assert squeezed == together
