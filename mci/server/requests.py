"""OpenAI API semantics of requests: request models -> (prompts, SamplingParams, resume).
Shared by the HTTP server and `mci run-batch`; responses.py turns results into bodies.

Types and unknown fields are checked by the pydantic models (`openai_types.py`); this module
adds the rules between fields and the features not built yet, each a 400 naming the field.
Value ranges are SamplingParams' own checks, reported under the API's name for the field.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager

from pydantic import BaseModel, ValidationError

from mci.core.request import Resume
from mci.core.sampling_params import SamplingParams
from mci.errors import InvalidParameter
from mci.grammar.constraint import Constraint
from mci.server.openai_types import (
    NOT_YET_SUPPORTED,
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    NativeSamplingParams,
)
from mci.server.tool_calls import ToolPlan
from mci.tokenizer import TextTokenizer


# ---- validation errors ------------------------------------------------------------------------
def _param_path(loc: tuple) -> str | None:
    """pydantic's error location -> `messages[0].content` (union-member tags dropped)."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part == "body" and not path:
            continue
        elif not any(c in part for c in "[]-") and part not in ("str", "int", "float", "bool"):
            path += f".{part}" if path else part
    return path or None


def from_validation_errors(errors: list[dict]) -> InvalidParameter:
    """The most specific problem of a failed validation, as one clear 400. For a value that
    matches no member of a union, the deepest error says most (`stop[0]`: a bad string in a
    list); equally deep alternatives are listed together."""
    if not errors:
        return InvalidParameter("invalid request")
    first = max(errors, key=lambda e: len(e.get("loc", ())))
    param = _param_path(tuple(first.get("loc", ())))
    kind = first.get("type", "")
    if kind == "extra_forbidden":
        name = str(first["loc"][-1])
        if name in NOT_YET_SUPPORTED:
            return InvalidParameter(f"'{name}' is not supported", param)
        return InvalidParameter(f"unknown field '{param}'", param)
    if kind == "json_invalid":
        return InvalidParameter(f"malformed JSON body: {first.get('msg', '')}")
    if kind == "missing":
        return InvalidParameter(f"'{param}' is required", param)
    if param is None:
        return InvalidParameter(f"request body: {first.get('msg', 'invalid')}")
    same = [e for e in errors if _param_path(tuple(e.get("loc", ()))) == param]
    messages = dict.fromkeys(e.get("msg", "").removeprefix("Value error, ") for e in same)
    return InvalidParameter(f"'{param}': {'; or '.join(list(messages)[:4])}", param)


def parse(model: type[BaseModel], body) -> BaseModel:
    """Validate a JSON body (run-batch; the server lets FastAPI do it with the same models)."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise from_validation_errors(exc.errors()) from None


# ---- requests -> SamplingParams ---------------------------------------------------------------
# Each API's names for the engine's parameters: an engine error about `max_new_tokens` is
# reported to an OpenAI client as an error about `max_tokens`.
_OPENAI_NAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens"}
COMPLETION_NAMES = {**_OPENAI_NAMES, "prompt_logprobs": "logprobs"}
CHAT_NAMES = {**_OPENAI_NAMES, "logprobs": "top_logprobs", "prompt": "messages"}
# SGLang's native API uses the engine's names, except its constraint fields (and the kind a
# compile error reports) sit under sampling_params
NATIVE_NAMES: dict[str, str] = {
    "json_schema": "sampling_params.json_schema",
    "response_format": "sampling_params.json_schema",
    "regex": "sampling_params.regex",
    "ebnf": "sampling_params.ebnf",
}


@contextmanager
def reported_as(names: dict[str, str]) -> Iterator[None]:
    """Re-raise an InvalidParameter from inside under the API's name for the field."""
    try:
        yield
    except InvalidParameter as exc:
        raise exc.renamed(names) from None


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float]:
    if not bias:
        return {}
    try:
        return {int(k): v for k, v in bias.items()}
    except ValueError:
        raise InvalidParameter("'logit_bias' keys must be token ids", "logit_bias") from None


def _build(names: dict[str, str], **kwargs) -> SamplingParams:
    """SamplingParams, with a range error reported under the API's name for the field."""
    with reported_as(names):
        return SamplingParams(**{k: v for k, v in kwargs.items() if v is not None})


def _common(req) -> dict:
    stop = req.stop
    return dict(
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        min_p=req.min_p,
        repetition_penalty=req.repetition_penalty,
        frequency_penalty=req.frequency_penalty,
        presence_penalty=req.presence_penalty,
        seed=req.seed,
        stop=(stop,) if isinstance(stop, str) else tuple(stop or ()),
        stop_token_ids=tuple(req.stop_token_ids or ()),
        ignore_eos=req.ignore_eos,
        n=req.n,
        skip_special_tokens=req.skip_special_tokens,
        logit_bias=_logit_bias(req.logit_bias),
        speculative=req.speculative,
        constraint=_constraint(req),
    )


def _constraint(req) -> Constraint | None:
    """The output constraint of an OpenAI-style or native request: at most one of the
    structured-output fields (each API's spelling)."""
    given = []
    fmt = getattr(req, "response_format", None)
    if fmt is not None and fmt.type == "json_object":
        given.append(("response_format", Constraint("json")))
    elif fmt is not None and fmt.type == "json_schema":
        schema = (fmt.json_schema or {}).get("schema")
        if not isinstance(schema, dict):
            raise InvalidParameter(
                "response_format json_schema needs 'json_schema': {'name', 'schema'}",
                "response_format",
            )
        given.append(("response_format", Constraint("json_schema", json.dumps(schema))))
    for name, kind in (
        ("regex", "regex"),
        ("guided_regex", "regex"),
        ("ebnf", "ebnf"),
        ("guided_grammar", "ebnf"),
    ):
        value = getattr(req, name, None)
        if value is not None:
            given.append((name, Constraint(kind, value)))
    for name in ("choice", "guided_choice"):
        value = getattr(req, name, None)
        if value is not None:
            if not value or not all(value):
                raise InvalidParameter(f"'{name}' must be non-empty strings", name)
            given.append((name, Constraint.choice(value)))
    for name in ("json_schema", "guided_json"):
        value = getattr(req, name, None)
        if value is not None:
            given.append((name, Constraint("json_schema", _schema_text(value, name))))
    if len(given) > 1:
        names = ", ".join(f"'{n}'" for n, _ in given)
        raise InvalidParameter(f"at most one output constraint: got {names}", given[1][0])
    return given[0][1] if given else None


def _schema_text(value, name: str) -> str:
    """A JSON Schema given as an object or as JSON text, as canonical JSON text."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise InvalidParameter(f"'{name}' is not valid JSON: {exc}", name) from None
    if not isinstance(value, dict):
        raise InvalidParameter(f"'{name}' must be a JSON Schema object", name)
    return json.dumps(value)


def _check_stream_options(req) -> None:
    if req.stream_options is not None and not req.stream:
        raise InvalidParameter(
            "'stream_options' is only allowed when 'stream' is true", "stream_options"
        )


def completion_params(req: CompletionRequest) -> SamplingParams:
    """Sampling for /v1/completions; `echo` with `logprobs` also scores the prompt."""
    _check_stream_options(req)
    if req.suffix:
        raise InvalidParameter("'suffix' is not supported", "suffix")
    if req.best_of is not None and req.best_of != (req.n or 1):
        raise InvalidParameter("'best_of' is only supported equal to 'n'", "best_of")
    scoring = req.logprobs if req.echo and req.logprobs is not None else None
    return _build(
        COMPLETION_NAMES,
        **_common(req),
        max_new_tokens=16 if req.max_tokens is None else req.max_tokens,
        min_new_tokens=req.min_tokens,
        logprobs=req.logprobs,
        prompt_logprobs=scoring,
    )


def chat_params(
    req: ChatCompletionRequest,
    tools: ToolPlan | None = None,
    reasoning: bool = False,
    think_end_id: int | None = None,
) -> SamplingParams:
    """Sampling for /v1/chat/completions; `tools` (tool_calls.plan_tools) constrains the
    output to a call under tool_choice required or a named function. With `reasoning`
    (--reasoning-parser), a constraint applies to the answer: after the `</think>` token,
    `think_end_id`."""
    _check_stream_options(req)
    if not req.tools and req.tool_choice not in (None, "none"):
        raise InvalidParameter("'tool_choice' needs 'tools'", "tool_choice")
    if req.top_logprobs is not None and not req.logprobs:
        raise InvalidParameter("'top_logprobs' requires 'logprobs': true", "top_logprobs")
    max_tokens = req.max_tokens if req.max_completion_tokens is None else req.max_completion_tokens
    common = _common(req)
    if tools is not None and tools.constraint is not None:
        if common["constraint"] is not None:
            raise InvalidParameter(
                "tool_choice required or a named function cannot be combined with another "
                "output constraint",
                "tool_choice",
            )
        common["constraint"] = tools.constraint
    if reasoning and common["constraint"] is not None:
        if think_end_id is None:
            raise InvalidParameter(
                "structured output with --reasoning-parser needs a tokenizer whose </think> "
                "is one token (the answer's constraint starts after it)",
                "tool_choice" if tools is not None and tools.constraint else "response_format",
            )
        common["constraint_start_token_id"] = think_end_id
    return _build(
        CHAT_NAMES,
        **common,
        max_new_tokens=16 if max_tokens is None else max_tokens,
        min_new_tokens=req.min_tokens,
        logprobs=(req.top_logprobs or 0) if req.logprobs else None,
    )


def native_params(sp: NativeSamplingParams | None) -> SamplingParams:
    """SGLang's sampling_params, names unchanged."""
    sp = sp or NativeSamplingParams()
    with reported_as(NATIVE_NAMES):
        common = _common(sp)
    return _build(
        NATIVE_NAMES,
        **common,
        max_new_tokens=16 if sp.max_new_tokens is None else sp.max_new_tokens,
        min_new_tokens=sp.min_new_tokens,
    )


# ---- prompts ----------------------------------------------------------------------------------
def completion_prompts(req: CompletionRequest) -> list[str | list[int]]:
    """`prompt` as a string, list of strings, token ids, or list of token-id lists."""
    return _prompt_list(req.prompt, "prompt")


def generate_prompts(req: GenerateRequest) -> list[str | list[int]]:
    if (req.text is None) == (req.input_ids is None):
        raise InvalidParameter("give exactly one of 'text' or 'input_ids'", "text")
    if req.text is not None:
        return _prompt_list(req.text, "text")
    return _prompt_list(req.input_ids, "input_ids")


def _prompt_list(prompt, name: str) -> list[str | list[int]]:
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        return [prompt]
    if not prompt:
        raise InvalidParameter(f"'{name}' must not be empty", name)
    return list(prompt)


def chat_prompt_ids(tokenizer: TextTokenizer, req: ChatCompletionRequest) -> list[int]:
    """Render `messages` through the model's chat template (as transformers does)."""
    messages = []
    for i, m in enumerate(req.messages):
        content = m.content
        if m.tool_calls is not None and m.role != "assistant":
            raise InvalidParameter(
                f"messages[{i}].tool_calls is only for role 'assistant'",
                f"messages[{i}].tool_calls",
            )
        if (m.tool_call_id is None) == (m.role == "tool"):
            raise InvalidParameter(
                f"messages[{i}].tool_call_id is required for role 'tool', and only for it",
                f"messages[{i}].tool_call_id",
            )
        if content is None and m.role != "assistant":
            raise InvalidParameter(
                f"messages[{i}].content is required for role {m.role!r}", f"messages[{i}].content"
            )
        if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
            content = "".join(part.text for part in content)
        message = {"role": "system" if m.role == "developer" else m.role, "content": content or ""}
        if m.name is not None:
            message["name"] = m.name
        if m.tool_calls is not None:
            message["tool_calls"] = [c.model_dump() for c in m.tool_calls]
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        messages.append(message)
    # the template shows the tools whatever tool_choice is (mci.server.tool_calls)
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
    return tokenizer.encode_chat(messages, tools=tools)


def resume_of(req, num_prompts: int) -> Resume | None:
    """The output a router asks to continue from (`resume_output_token_ids`), checked as far
    as the request alone allows (the engine's front checks the rest)."""
    if req.resume_output_token_ids is None:
        if req.resume_text_offset is not None:
            raise InvalidParameter(
                "'resume_text_offset' needs 'resume_output_token_ids'", "resume_text_offset"
            )
        return None
    if num_prompts != 1 or getattr(req, "echo", False):
        raise InvalidParameter(
            "'resume_output_token_ids' needs exactly one prompt and no echo",
            "resume_output_token_ids",
        )
    return Resume(tuple(req.resume_output_token_ids), req.resume_text_offset or 0)
