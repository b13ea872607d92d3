"""The in-process Engine: blocking generate, async streaming, abort, stops, UTF-8 deltas."""

from __future__ import annotations

import asyncio
import time

import pytest

from mci.cache.config import CacheConfig
from mci.core.sampling_params import SamplingParams
from mci.engine.config import EngineConfig, ModelPlacement
from mci.engine.engine import Engine
from mci.errors import UserError
from mci.scheduler.detokenizer import IncrementalDetokenizer
from mci.tokenizer import TextTokenizer


@pytest.fixture(scope="module")
def engine(checkpoint):
    path = checkpoint()
    eng = Engine(
        EngineConfig(
            model=ModelPlacement(model_path=path, dtype="float32", skip_kernel_warmup=True),
            cache=CacheConfig(max_total_tokens=8192),
            check_integrity=True,
        )
    )
    yield eng
    eng.shutdown()


def _greedy(n, **kw):
    return SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True, **kw)


def test_generate_text_and_token_prompts(engine):
    text = engine.generate("def main():", _greedy(8))[0]
    ids = engine.tokenizer.encode("def main():")
    by_ids = engine.generate(ids, _greedy(8))[0]
    assert text.prompt_token_ids == ids
    assert text.outputs[0].output_token_ids == by_ids.outputs[0].output_token_ids
    assert len(text.outputs[0].output_token_ids) == 8 and text.outputs[0].finish_reason == "length"
    engine.check_idle_integrity()


def test_seeded_sampling_is_reproducible_in_any_batch(engine):
    params = SamplingParams(max_new_tokens=16, temperature=1.0, seed=1234, ignore_eos=True)
    alone = engine.generate("import os", params)[0].outputs[0].output_token_ids
    noise = SamplingParams(max_new_tokens=20, temperature=1.0, ignore_eos=True)
    for p in ["class A:", "x = [", "while True:"]:
        engine.add_request(p, noise, lambda o: None)
    mixed = engine.generate(["import os", "import os"], params)
    assert all(r.outputs[0].output_token_ids == alone for r in mixed)


def test_n_samples_with_seed_differ_but_reproduce(engine):
    params = SamplingParams(max_new_tokens=12, temperature=1.0, seed=5, n=3, ignore_eos=True)
    a = engine.generate("import sys", params)[0]
    b = engine.generate("import sys", params)[0]
    ids_a = [o.output_token_ids for o in a.outputs]
    assert ids_a == [o.output_token_ids for o in b.outputs]
    assert len({tuple(x) for x in ids_a}) > 1


def test_stop_string_cuts_exactly(engine):
    full = engine.generate("def main():", _greedy(40))[0].outputs[0].text
    stop = full[10:13]
    assert stop and stop in full
    out = engine.generate("def main():", _greedy(40, stop=[stop]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full[: full.index(stop)]
    assert stop not in out.text


def test_stream_deltas_reassemble_to_final_text(engine):
    async def collect(params):
        deltas, final = [], None
        async for out in engine.stream("def main():", params):
            deltas.append(out.delta_text)
            final = out
        return deltas, final

    for params in (_greedy(30), _greedy(30, stop=["e"])):
        deltas, final = asyncio.run(collect(params))
        assert final.finished and "".join(deltas) == final.text


def test_stream_consumer_leaving_aborts_and_frees(engine):
    async def consume_three():
        count = 0
        async for _ in engine.stream("import re", _greedy(200)):
            count += 1
            if count == 3:
                break
        return count

    assert asyncio.run(consume_three()) == 3
    deadline = time.monotonic() + 5
    while engine.scheduler.has_work and time.monotonic() < deadline:
        time.sleep(0.01)
    engine.check_idle_integrity()


def test_abort_and_timeout_end_with_one_final_output(engine):
    finals = []
    rid = engine.add_request("x", _greedy(500), lambda o: o.finished and finals.append(o))[0]
    engine.abort(rid)
    timed = engine.generate("y", _greedy(500), timeout_s=0.05)[0].outputs[0]
    deadline = time.monotonic() + 5
    while not finals and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(finals) == 1 and finals[0].finish_reason == "abort"
    assert timed.finish_reason == "abort" and timed.error == "request timed out"
    engine.check_idle_integrity()


def test_bad_input_is_rejected_before_queueing(engine):
    with pytest.raises(UserError, match="context length"):
        engine.generate("x", _greedy(10_000))
    with pytest.raises(UserError, match="token ids"):
        engine.generate([999_999], _greedy(2))
    with pytest.raises(UserError, match="empty"):
        engine.generate([[]], _greedy(2))


def test_incremental_detokenizer_handles_split_utf8(checkpoint):
    tok = TextTokenizer.load(checkpoint())
    text = "naïve café ✓ 日本語 🙂 done"
    ids = tok.encode(text, add_bos=False)
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.step([t]) for t in ids]
    deltas.append(detok.flush())
    assert "".join(deltas) == text
    assert "" in deltas[:-1], "no token split a character: the test exercises nothing"
    assert all("\ufffd" not in d for d in deltas)


def test_foreground_engine_runs_the_loop_in_generate(checkpoint):
    """background=False: generate() drives the loop on the caller's thread; stream() refuses."""
    path = checkpoint()
    eng = Engine(
        EngineConfig(
            model=ModelPlacement(model_path=path, dtype="float32", skip_kernel_warmup=True),
            cache=CacheConfig(max_total_tokens=4096),
            check_integrity=True,
        ),
        background=False,
    )
    try:
        res = eng.generate(
            ["def f(x):", "import os"],
            SamplingParams(max_new_tokens=5, temperature=0.8, seed=3, n=2),
        )
        assert [len(r.outputs) for r in res] == [2, 2]
        assert all(len(o.output_token_ids) <= 5 and o.finished for r in res for o in r.outputs)
        eng.check_idle_integrity()

        async def try_stream():
            async for _ in eng.stream("x", _greedy(2)):
                pass

        with pytest.raises(RuntimeError, match="background"):
            asyncio.run(try_stream())
    finally:
        eng.shutdown()


def test_the_public_face_is_the_engine(checkpoint):
    """`from mci import Engine, EngineConfig, SamplingParams`, as the README's Python API shows;
    `import mci` alone loads no engine (the names load on first use)."""
    import subprocess
    import sys

    import mci
    from mci import Engine as PublicEngine
    from mci import EngineConfig as PublicConfig
    from mci import SamplingParams as PublicParams

    assert (PublicEngine, PublicConfig, PublicParams) == (Engine, EngineConfig, SamplingParams)
    assert set(mci.__all__) >= {"Engine", "EngineConfig", "SamplingParams"}
    light = "import sys, mci; print('mci.engine.engine' in sys.modules, 'torch' in sys.modules)"
    loaded = subprocess.run([sys.executable, "-c", light], capture_output=True, text=True)
    assert loaded.stdout.split() == ["False", "False"], loaded.stderr
    with pytest.raises(AttributeError):
        _ = mci.NoSuchThing

    config = PublicConfig(
        model=ModelPlacement(model_path=checkpoint(), dtype="float32", skip_kernel_warmup=True),
        cache=CacheConfig(max_total_tokens=2048),
    )
    engine = PublicEngine(config, background=False)
    try:
        params = PublicParams(max_new_tokens=4, ignore_eos=True)
        results = engine.generate(["def f(x):", [1, 2, 3]], params)
    finally:
        engine.shutdown()
    assert [len(r.outputs[0].output_token_ids) for r in results] == [4, 4]
