"""OpenAI API semantics of responses: engine results -> response bodies (completions, chat,
SGLang's native /generate), their logprobs, finish reasons and usage. Shared by the HTTP
server (whole bodies here, stream chunks in streaming.py) and `mci run-batch`.
"""

from __future__ import annotations

import time

from mci.core.outputs import RequestOutput
from mci.core.request_ids import new_request_id
from mci.core.sampling_params import SamplingParams
from mci.server.reasoning import split_reasoning
from mci.server.tool_calls import ToolPlan, parse_calls
from mci.tokenizer import TextTokenizer


def finish_reason(out: RequestOutput) -> str | None:
    """OpenAI's finish_reason: None until the end, then "length" or "stop" (an abort that
    reaches a response body is reported as a stop; errors have their own body)."""
    if not out.finished:
        return None
    return "length" if out.finish_reason == "length" else "stop"


def native_finish_reason(out: RequestOutput) -> dict | None:
    """SGLang's meta_info.finish_reason: the same rule, with what matched."""
    reason = finish_reason(out)
    return None if reason is None else {"type": reason, "matched": out.stop_reason}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage object; `prompt_tokens_details.cached_tokens`: prompt tokens served
    from the prefix cache (any tier) instead of computed."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def echo_text(tokenizer: TextTokenizer, prompt: str | list[int], ids: list[int]) -> str:
    """The prompt as echoed: the caller's text, or the decoded token ids."""
    return prompt if isinstance(prompt, str) else tokenizer.decode(ids)


def completion_logprobs(
    tokenizer: TextTokenizer, token_ids: list[int], logprobs: list, text_offset: int = 0
) -> tuple[dict, int]:
    """Completion-style `logprobs` for these tokens, whose text starts at `text_offset` in the
    choice's text; returns it and the offset after them. Entries of `logprobs` may be None
    (the first prompt token has no logprob)."""
    tokens, offsets = [], []
    for t in token_ids:
        offsets.append(text_offset)
        tokens.append(tokenizer.decode([t], skip_special_tokens=False))
        text_offset += len(tokenizer.decode([t]))
    body = {
        "tokens": tokens,
        "token_logprobs": [None if e is None else e[0] for e in logprobs],
        "top_logprobs": [
            None
            if e is None
            else {tokenizer.decode([i], skip_special_tokens=False): v for i, v in e[1]}
            for e in logprobs
        ],
        "text_offset": offsets,
    }
    return body, text_offset


def echo_logprobs(tokenizer: TextTokenizer, ids: list[int], out: RequestOutput) -> dict | None:
    """Prompt logprobs of an echoed prompt (None when the prompt was not scored)."""
    if out.prompt_logprobs is None:
        return None
    return completion_logprobs(tokenizer, ids, out.prompt_logprobs)[0]


def _join_logprobs(first: dict | None, second: dict | None) -> dict | None:
    if first is None or second is None:
        return first or second
    return {key: first[key] + second[key] for key in first}


def completion_response(
    model: str,
    tokenizer: TextTokenizer,
    prompts: list[tuple[str | list[int], list[int]]],
    results: list[list[RequestOutput]],
    params: SamplingParams,
    echo: bool = False,
    request_id: str | None = None,
) -> dict:
    """`text_completion` body: choice index runs over prompts, then samples. With echo the
    choice's text (and its logprobs, when asked) cover the prompt, then the completion."""
    choices, prompt_tokens, completion_tokens, cached_tokens = [], 0, 0, 0
    for (prompt, ids), outs in zip(prompts, results, strict=True):
        prompt_tokens += len(ids)
        cached_tokens += outs[0].num_cached_tokens if outs else 0  # the prompt's first sample
        prefix = echo_text(tokenizer, prompt, ids) if echo else ""
        for out in outs:
            completion_tokens += len(out.output_token_ids)
            lp = None
            if params.logprobs is not None:
                lp, _ = completion_logprobs(
                    tokenizer, out.output_token_ids, out.logprobs, len(prefix)
                )
                if echo:
                    lp = _join_logprobs(echo_logprobs(tokenizer, ids, out), lp)
            choices.append(
                {
                    "index": len(choices),
                    "text": prefix + out.text,
                    "logprobs": lp,
                    "finish_reason": finish_reason(out),
                }
            )
    return {
        "id": request_id or new_request_id("cmpl"),
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage(prompt_tokens, completion_tokens, cached_tokens),
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
    tools: ToolPlan | None = None,
    reasoning: bool = False,
) -> dict:
    """`chat.completion` body with one choice per sample; an output that is a call of one of
    `tools` becomes `tool_calls`."""
    choices = []
    for i, out in enumerate(outputs):
        lp = chat_logprobs(tokenizer, out.output_token_ids, out.logprobs) if out.logprobs else None
        message, reason = chat_message(out, tools, reasoning)
        choices.append({"index": i, "message": message, "logprobs": lp, "finish_reason": reason})
    return {
        "id": request_id or new_request_id("chatcmpl"),
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage(
            prompt_len,
            sum(len(o.output_token_ids) for o in outputs),
            outputs[0].num_cached_tokens if outputs else 0,
        ),
    }


def chat_message(
    out: RequestOutput, tools: ToolPlan | None, reasoning: bool = False
) -> tuple[dict, str | None]:
    """A finished chat output's message and finish_reason ("tool_calls" for a call); with
    `reasoning`, the text before </think> goes to reasoning_content (server/reasoning.py)."""
    reason = finish_reason(out)
    message: dict = {"role": "assistant", "content": out.text}
    if reasoning:
        message["reasoning_content"], message["content"] = split_reasoning(out.text)
    if tools is None or reason != "stop":
        return message, reason
    content, calls = parse_calls(message["content"] or "", tools)
    if not calls:
        return message, reason
    return {**message, "content": content, "tool_calls": calls}, "tool_calls"


def native_response(out: RequestOutput, prompt_len: int) -> dict:
    """One sample's body of SGLang's /generate."""
    return {
        "text": out.text,
        "output_ids": out.output_token_ids,
        "meta_info": {
            "id": out.request_id,
            "finish_reason": native_finish_reason(out),
            "prompt_tokens": prompt_len,
            "completion_tokens": len(out.output_token_ids),
            "cached_tokens": out.num_cached_tokens,
            # by tier, with --enable-hierarchical-cache: device (L1), host (L2), storage (L3)
            **(
                {"cached_tokens_details": out.cached_tokens_details}
                if out.cached_tokens_details is not None
                else {}
            ),
        },
    }
