"""Structured output: JSON Schema, JSON, regex, EBNF and choices through xgrammar in the
batched sampler. The random-weight `tiny` model samples at temperature 1, so only the grammar
makes its output valid."""

from __future__ import annotations

import dataclasses
import json
import re

import jsonschema
import pytest
from engine_helpers import OracleDrafter, drive
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mci.cache.config import CacheConfig
from mci.core.request import Request
from mci.core.sampling_params import SamplingParams
from mci.engine.builder import build_engine_core
from mci.engine.config import EngineConfig, ModelPlacement
from mci.errors import InvalidParameter
from mci.grammar.cache import xgrammar_cache
from mci.grammar.constraint import Constraint
from mci.models.loader import load_model
from mci.runner.model_runner import ModelRunner
from mci.scheduler.config import SchedulerConfig
from mci.speculative.config import SpeculativeConfig
from mci.speculative.speculator import Speculator
from mci.tokenizer import TextTokenizer


@pytest.fixture(scope="module")
def tiny(checkpoint):
    path = checkpoint()
    return path, load_model(path, "float32"), TextTokenizer.load(path)


def _core(tiny, spec=None, **sched):
    path, model, tok = tiny
    config = EngineConfig(
        model=ModelPlacement(model_path=path, dtype="float32", skip_kernel_warmup=True),
        cache=CacheConfig(max_total_tokens=sched.pop("max_total_tokens", 8192)),
        scheduler=dataclasses.replace(SchedulerConfig(), **sched),
        speculative=spec or SpeculativeConfig(),
        check_integrity=True,
    )
    return build_engine_core(config, model, tok)


def _texts(tiny, prompts, params_list, core=None, tag="q"):
    core = core or _core(tiny)
    _, _, tok = tiny
    reqs = [
        Request(f"{tag}{i}", tok.encode(p), params)
        for i, (p, params) in enumerate(zip(prompts, params_list, strict=True))
    ]
    for req in reqs:
        if req.params.constraint is not None:
            core.grammar.compile_now(req.params.constraint)  # as the front end does
    finals = drive(core, {0: reqs})
    return [finals[f"{tag}{i}"] for i in range(len(reqs))]


def _params(constraint, seed=0, max_new_tokens=160, **kw):
    return SamplingParams(
        max_new_tokens=max_new_tokens, temperature=1.0, seed=seed, constraint=constraint, **kw
    )


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 8}},
            "required": ["city"],
        },
    },
    "required": ["name", "age", "address"],
}


def test_json_schema_regex_choice_ebnf_and_json_always_match(tiny):
    cases = [
        (
            Constraint("json_schema", json.dumps(PERSON)),
            lambda t: jsonschema.validate(json.loads(t), PERSON),
        ),
        (Constraint("json"), json.loads),
        (
            Constraint("regex", r"[0-9]{3}-[a-z]{2,4}"),
            lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", t) or pytest.fail(t),
        ),
        (
            Constraint.choice(["red", "green", "blue"]),
            lambda t: t in ("red", "green", "blue") or pytest.fail(t),
        ),
        (
            Constraint("ebnf", 'root ::= "(" [a-c]+ ")"'),
            lambda t: re.fullmatch(r"\([a-c]+\)", t) or pytest.fail(t),
        ),
    ]
    prompts, params, checks = [], [], []
    for i, (constraint, check) in enumerate(cases):
        for seed in range(3):
            prompts.append(f"prompt {i} {seed}:")
            # JSON without bounds can run long at temperature 1: give it room
            params.append(_params(constraint, seed, 400 if constraint.kind == "json" else 160))
            checks.append(check)
    outs = _texts(tiny, prompts, params)
    for out, check in zip(outs, checks, strict=True):
        assert out.finish_reason == "stop", out.text
        check(out.text)


def test_unconstrained_requests_unchanged_beside_constrained_ones(tiny):
    prompts = [f"row {i}" for i in range(6)]
    plain = [SamplingParams(max_new_tokens=12, temperature=0.8, seed=i) for i in range(6)]
    alone = _texts(tiny, prompts, plain, tag="a")
    mixed_params = [
        p if i % 2 else _params(Constraint("regex", "[a-z]{1,6}"), i) for i, p in enumerate(plain)
    ]
    mixed = _texts(tiny, prompts, mixed_params, tag="m")
    for i in range(1, 6, 2):
        assert mixed[i].output_token_ids == alone[i].output_token_ids


def test_bad_constraints_are_rejected_before_queueing(tiny):
    path, _, tok = tiny
    cache = xgrammar_cache(tok, 2048, (1,))
    for constraint, param in (
        (Constraint("regex", "(("), "regex"),
        (Constraint("ebnf", "root ::= missing_rule"), "ebnf"),
        (Constraint("json_schema", json.dumps({"type": "nonsense"})), "response_format"),
        (Constraint.choice([]), "choice"),
    ):
        with pytest.raises(InvalidParameter) as err:
            cache.compile_now(constraint)
        assert err.value.param == param
        assert "constraint" in str(err.value) and ".cc:" not in str(err.value)


def test_speculation_with_a_grammar_is_identical_and_valid(tiny):
    prompts = [f"spec {i}" for i in range(4)]
    schema = Constraint("json_schema", json.dumps(PERSON))
    greedy = [SamplingParams(max_new_tokens=120, temperature=0, constraint=schema) for _ in prompts]
    reference = _texts(tiny, prompts, greedy, tag="r")
    truth = {str(i): o.output_token_ids for i, o in enumerate(reference)}
    spec = SpeculativeConfig(
        speculative_algorithm="ngram", speculative_num_steps=3, speculative_disable_by_batch_size=64
    )
    for drafter in (None, OracleDrafter(truth, wrong_every=3)):
        core = _core(tiny, spec)
        if drafter is not None:
            r = core.runner
            core.runner = ModelRunner(r.model, r.kv_cache, r.eos_ids, Speculator(spec, drafter))
        got = _texts(tiny, prompts, greedy, core=core, tag="s")
        assert [o.output_token_ids for o in got] == [o.output_token_ids for o in reference]
        for o in got:
            jsonschema.validate(json.loads(o.text), PERSON)
        if drafter is not None:
            assert core.counters["spec_decode_num_accepted_tokens"] > 0


# ---- generated schemas ---------------------------------------------------------------------
def _leaf():
    return st.one_of(
        st.builds(
            lambda n, x: {"type": "string", "minLength": n, "maxLength": n + x},
            st.integers(0, 3),
            st.integers(0, 6),
        ),
        st.builds(
            lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
            st.integers(-50, 50),
            st.integers(0, 100),
        ),
        st.just({"type": "boolean"}),
        st.lists(st.sampled_from(["x", "yy", "zzz", "w"]), min_size=1, max_size=3, unique=True).map(
            lambda e: {"enum": e}
        ),
        st.just({"type": "string", "pattern": "^[a-f]{1,4}$"}),
    )


def _schema(depth: int = 2):
    if depth == 0:
        return _leaf()
    child = _schema(depth - 1)
    obj = st.dictionaries(
        st.sampled_from(["a", "b", "c", "d"]), child, min_size=1, max_size=3
    ).flatmap(
        lambda props: st.lists(st.sampled_from(sorted(props)), unique=True).map(
            lambda req: {"type": "object", "properties": props, "required": req}
        )
    )
    arr = st.builds(
        lambda items, n: {"type": "array", "items": items, "maxItems": n}, child, st.integers(0, 3)
    )
    return st.one_of(_leaf(), obj, arr)


@pytest.fixture(scope="module")
def shared_core(tiny):
    """One engine (and one grammar cache) for every generated schema."""
    return _core(tiny)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(schema=_schema(), seed=st.integers(0, 1000))
def test_generated_schemas_always_validate(tiny, shared_core, schema, seed):
    constraint = Constraint("json_schema", json.dumps(schema))
    params = [_params(constraint, seed, 300)]
    (out,) = _texts(tiny, ["value:"], params, core=shared_core, tag="h")
    assert out.finish_reason == "stop", (schema, out.text)
    jsonschema.validate(json.loads(out.text), schema)


def test_served_structured_outputs(checkpoint):
    """Through `mci serve` and the official client: response_format json_schema (chat and
    completions), json_object, regex and choice (both spellings), a 400 for a bad regex."""
    import openai
    from server_helpers import LiveServer

    path = checkpoint()
    with LiveServer(path, "--served-model-name", "m") as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
        chat = client.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "a person"}],
            response_format=fmt,
            max_tokens=200,
            seed=1,
        ).choices[0]
        assert chat.finish_reason == "stop"
        jsonschema.validate(json.loads(chat.message.content), PERSON)
        streamed = "".join(
            c.choices[0].text
            for c in client.completions.create(
                model="m",
                prompt="x",
                max_tokens=200,
                seed=2,
                stream=True,
                extra_body={"response_format": fmt},
            )
        )
        jsonschema.validate(json.loads(streamed), PERSON)
        obj = (
            client.completions.create(
                model="m",
                prompt="x",
                max_tokens=400,
                seed=3,
                extra_body={"response_format": {"type": "json_object"}},
            )
            .choices[0]
            .text
        )
        json.loads(obj)
        for field in ("regex", "guided_regex"):
            text = (
                client.completions.create(
                    model="m", prompt="id:", max_tokens=30, extra_body={field: "[A-Z]{2}[0-9]{3}"}
                )
                .choices[0]
                .text
            )
            assert re.fullmatch("[A-Z]{2}[0-9]{3}", text), text
        for field in ("choice", "guided_choice"):
            text = (
                client.completions.create(
                    model="m", prompt="pick:", max_tokens=10, extra_body={field: ["left", "right"]}
                )
                .choices[0]
                .text
            )
            assert text in ("left", "right")
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model="m", prompt="x", extra_body={"regex": "(("})
        assert err.value.body["param"] == "regex"
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(
                model="m", prompt="x", extra_body={"regex": "a", "choice": ["b"]}
            )
        assert "at most one" in err.value.body["message"]
        state = server.wait_idle()
    assert state["free_slots"] + state["tree_tokens"] == state["num_slots"]


def test_constraint_travels_with_the_params():
    params = SamplingParams(constraint=Constraint.choice(["a", "b"]))
    assert hash(params) == hash(dataclasses.replace(params))
    assert params.constraint.options == ["a", "b"]


LONG_KEYS = {
    "type": "object",
    "properties": {
        "customer_identifier_string": {"type": "string", "maxLength": 6},
        "total_order_amount_in_cents": {"type": "integer", "minimum": 0, "maximum": 999},
        "shipping_method_preference": {"enum": ["standard_ground", "express_overnight"]},
    },
    "required": [
        "customer_identifier_string",
        "total_order_amount_in_cents",
        "shipping_method_preference",
    ],
}


def test_jump_forward_is_valid_and_saves_steps(tiny):
    """Jump-forward appends the text the grammar forces (the long fixed keys) without a model
    step per token: valid output either way, in fewer forward steps."""
    constraint = Constraint("json_schema", json.dumps(LONG_KEYS))
    prompts = [f"order {i}:" for i in range(3)]
    results = {}
    for jump in (False, True):
        core = _core(tiny, enable_jump_forward=jump)
        steps = 0
        execute = core.runner.execute

        def counted(batch, execute=execute):
            nonlocal steps
            steps += 1
            return execute(batch)

        core.runner.execute = counted
        params = [_params(constraint, seed=i, max_new_tokens=200) for i in range(3)]
        outs = _texts(tiny, prompts, params, core=core, tag=f"j{int(jump)}")
        for out in outs:
            assert out.finish_reason == "stop", out.text
            jsonschema.validate(json.loads(out.text), LONG_KEYS)
        results[jump] = steps
    assert results[True] < results[False] / 2, results
