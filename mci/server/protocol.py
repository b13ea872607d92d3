"""OpenAI API shapes: request bodies -> (prompts, SamplingParams), engine results -> responses.

Shared by the HTTP server and `mci run-batch`. Validation is explicit and names the offending
parameter, so a client's mistake becomes a 400 with `param` set, never a 500.
Extras accepted like SGLang/vLLM: top_k, min_p, repetition_penalty, ignore_eos, min_tokens,
stop_token_ids, skip_special_tokens, priority.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from mci.core.outputs import RequestOutput
from mci.core.sampling_params import SamplingParams
from mci.errors import UserError
from mci.tokenizer import TextTokenizer

_MISSING = object()


class InvalidRequest(UserError):
    """A malformed request body; `param` names the field (OpenAI's error.param)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def _field(body: dict, name: str, kinds: tuple, default: Any = _MISSING):
    """body[name] checked against `kinds`; absent or null means `default` (or required)."""
    value = body.get(name)
    if value is None:
        if default is _MISSING:
            raise InvalidRequest(f"'{name}' is required", name)
        return default
    if (isinstance(value, bool) and bool not in kinds) or not isinstance(value, kinds):
        raise InvalidRequest(f"'{name}' must be of type {kinds[0].__name__}", name)
    return value


_NUM = (float, int)


def sampling_params(body: dict, *, chat: bool) -> SamplingParams:
    """Map OpenAI/vLLM sampling fields to SamplingParams (400 on any bad value)."""
    if not isinstance(body, dict):
        raise InvalidRequest("request body must be a JSON object")
    max_tokens = _field(body, "max_tokens", (int,), None)
    if chat:
        max_tokens = _field(body, "max_completion_tokens", (int,), None) or max_tokens
    stop = _field(body, "stop", (str, list), None)
    stop = [stop] if isinstance(stop, str) else (stop or [])
    if not all(isinstance(s, str) for s in stop):
        raise InvalidRequest("'stop' must be a string or a list of strings", "stop")
    if chat:
        want = _field(body, "logprobs", (bool,), False)
        top = _field(body, "top_logprobs", (int,), None)
        if top is not None and not want:
            raise InvalidRequest("'top_logprobs' requires 'logprobs': true", "top_logprobs")
        logprobs = (top or 0) if want else None
    else:
        logprobs = _field(body, "logprobs", (int,), None)
    kwargs = dict(
        max_new_tokens=16 if max_tokens is None else max_tokens,
        temperature=float(_field(body, "temperature", _NUM, 1.0)),
        top_p=float(_field(body, "top_p", _NUM, 1.0)),
        top_k=_field(body, "top_k", (int,), 0),
        min_p=float(_field(body, "min_p", _NUM, 0.0)),
        repetition_penalty=float(_field(body, "repetition_penalty", _NUM, 1.0)),
        frequency_penalty=float(_field(body, "frequency_penalty", _NUM, 0.0)),
        presence_penalty=float(_field(body, "presence_penalty", _NUM, 0.0)),
        seed=_field(body, "seed", (int,), None),
        stop=tuple(stop),
        stop_token_ids=tuple(_field(body, "stop_token_ids", (list,), None) or ()),
        ignore_eos=_field(body, "ignore_eos", (bool,), False),
        min_new_tokens=_field(body, "min_tokens", (int,), 0),
        n=_field(body, "n", (int,), 1),
        logprobs=logprobs,
        skip_special_tokens=_field(body, "skip_special_tokens", (bool,), True),
    )
    try:
        return SamplingParams(**kwargs)
    except UserError as exc:
        param = str(exc).split(" ", 1)[0]
        param = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens"}.get(param, param)
        raise InvalidRequest(str(exc).replace("max_new_tokens", "max_tokens"), param) from None


def completion_prompts(body: dict) -> list[str | list[int]]:
    """`prompt` as a string, list of strings, token ids, or list of token-id lists."""
    prompt = _field(body, "prompt", (str, list))
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise InvalidRequest("'prompt' must not be empty", "prompt")
    if all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
        return [prompt]
    if all(isinstance(p, str) for p in prompt):
        return list(prompt)
    if all(isinstance(p, list) and p and all(isinstance(t, int) for t in p) for p in prompt):
        return list(prompt)
    raise InvalidRequest(
        "'prompt' must be a string, a list of strings, a list of token ids, "
        "or a list of token-id lists",
        "prompt",
    )


def chat_prompt_ids(tokenizer: TextTokenizer, body: dict) -> list[int]:
    """Render `messages` through the model's chat template."""
    messages = _field(body, "messages", (list,))
    if not messages:
        raise InvalidRequest("'messages' must not be empty", "messages")
    clean = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in (
            "system",
            "user",
            "assistant",
            "developer",
        ):
            raise InvalidRequest(
                f"messages[{i}] needs a role of system, user or assistant", "messages"
            )
        content = m.get("content", "")
        if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
            if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                raise InvalidRequest(
                    f"messages[{i}].content: only text parts are supported", "messages"
                )
            content = "".join(str(p.get("text", "")) for p in content)
        if not isinstance(content, str):
            raise InvalidRequest(f"messages[{i}].content must be a string", "messages")
        role = "system" if m["role"] == "developer" else m["role"]
        clean.append({"role": role, "content": content})
    return tokenizer.encode_chat(clean)


def _finish_reason(out: RequestOutput) -> str:
    return "length" if out.finish_reason == "length" else "stop"


def _usage(prompt_tokens: int, outputs: list[RequestOutput]) -> dict:
    completion = sum(len(o.output_token_ids) for o in outputs)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
    }


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def completion_response(
    model: str,
    tokenizer: TextTokenizer,
    prompts: list[tuple[str | list[int], list[int]]],
    results: list[list[RequestOutput]],
    echo: bool = False,
    request_id: str | None = None,
) -> dict:
    """`text_completion` body: choice index runs over prompts, then samples."""
    choices, prompt_tokens, everything = [], 0, []
    for (prompt, ids), outs in zip(prompts, results, strict=True):
        prompt_tokens += len(ids)
        prefix = (prompt if isinstance(prompt, str) else tokenizer.decode(ids)) if echo else ""
        for out in outs:
            lp = None
            if out.logprobs:
                lp = completion_logprobs(tokenizer, out.output_token_ids, out.logprobs)
            choices.append(
                {
                    "index": len(choices),
                    "text": prefix + out.text,
                    "logprobs": lp,
                    "finish_reason": _finish_reason(out),
                }
            )
            everything.append(out)
    return {
        "id": request_id or new_id("cmpl"),
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": _usage(prompt_tokens, everything),
    }


def completion_logprobs(tokenizer: TextTokenizer, token_ids: list[int], logprobs: list) -> dict:
    """Completion-style `logprobs` for the given tokens (a whole choice or a stream chunk)."""
    tokens = [tokenizer.decode([t], skip_special_tokens=False) for t in token_ids]
    return {
        "tokens": tokens,
        "token_logprobs": [lp for lp, _ in logprobs],
        "top_logprobs": [
            {tokenizer.decode([i], skip_special_tokens=False): v for i, v in alts}
            for _, alts in logprobs
        ],
        "text_offset": [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))],
    }


def chat_logprobs(tokenizer: TextTokenizer, token_ids: list[int], logprobs: list) -> dict:
    """Chat `logprobs.content` entries for the given tokens."""

    def entry(tid: int, lp: float) -> dict:
        text = tokenizer.decode([tid], skip_special_tokens=False)
        return {"token": text, "logprob": lp, "bytes": list(text.encode())}

    return {
        "content": [
            {**entry(t, lp), "top_logprobs": [entry(i, v) for i, v in alts]}
            for t, (lp, alts) in zip(token_ids, logprobs, strict=True)
        ]
    }


def chat_response(
    model: str,
    tokenizer: TextTokenizer,
    prompt_len: int,
    outputs: list[RequestOutput],
    request_id: str | None = None,
) -> dict:
    """`chat.completion` body with one choice per sample."""
    choices = []
    for i, out in enumerate(outputs):
        lp = chat_logprobs(tokenizer, out.output_token_ids, out.logprobs) if out.logprobs else None
        choices.append(
            {
                "index": i,
                "message": {"role": "assistant", "content": out.text},
                "logprobs": lp,
                "finish_reason": _finish_reason(out),
            }
        )
    return {
        "id": request_id or new_id("chatcmpl"),
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": _usage(prompt_len, outputs),
    }
