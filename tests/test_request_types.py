"""The request models' prompt fields: the fast path for a plain token-id prompt accepts and
rejects exactly what the whole union does (the same values, the same 400s)."""

from __future__ import annotations

import pytest
from pydantic import BaseModel, ConfigDict, ValidationError

from mci.server.openai_types import IdPrompts, Prompts, Text, TokenIds
from mci.server.requests import from_validation_errors


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class UnionOnly(_Strict):  # the prompt field without the fast path
    prompt: Text | list[Text] | TokenIds | list[TokenIds]


class WithFastPath(_Strict):
    prompt: Prompts


class IdsUnionOnly(_Strict):
    prompt: TokenIds | list[TokenIds]


class IdsWithFastPath(_Strict):
    prompt: IdPrompts


PROMPTS = [
    "", "hi", "\x00", [], [0], [1, 2, 3], [2**70], [-1], [1, -2], [1.0], [True], [False, 1],
    [1, "a"], ["a", 1], ["a"], ["a", "\x00", 3], [[1]], [[]], [["a"]], [[1], [2, 3]],
    [[1], ["a"]], [[1, -2], [3, "a"]], [[1], 2], [[1], [], [5, -2]], [[1, 2], "x", [3, -1]],
    ["ok", ["x"]], [1, 2, 3.5], None, 5, {"a": 1},
]  # fmt: skip


def _outcome(model: type[BaseModel], prompt) -> tuple:
    try:
        value = model.model_validate({"prompt": prompt}).prompt
    except ValidationError as exc:
        error = from_validation_errors(exc.errors())
        return ("400", str(error), error.param)
    return ("ok", value, type(value))


@pytest.mark.parametrize("prompt", PROMPTS, ids=repr)
def test_the_plain_ids_fast_path_accepts_and_rejects_as_the_union_does(prompt):
    assert _outcome(WithFastPath, prompt) == _outcome(UnionOnly, prompt)
    assert _outcome(IdsWithFastPath, prompt) == _outcome(IdsUnionOnly, prompt)


def test_the_fast_path_leaves_the_json_schema_as_it_was():
    assert WithFastPath.model_json_schema() == {
        **UnionOnly.model_json_schema(),
        "title": "WithFastPath",
    }
