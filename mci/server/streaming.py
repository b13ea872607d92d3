"""Server-sent-event streams: OpenAI completion and chat chunks, and SGLang's native stream.

Every stream ends with `data: [DONE]`; an engine error becomes an error event. Whatever ends
the stream (done, error, client gone), its unfinished samples are aborted.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request

from mci.core.outputs import RequestOutput
from mci.core.sampling_params import SamplingParams
from mci.errors import error_body
from mci.http_stream import ClosingStreamingResponse
from mci.server import responses
from mci.server.engine_supervisor import ENGINE_DEATH_ERRORS
from mci.server.reasoning import ReasoningStream
from mci.server.state import ServerState
from mci.server.submission import Submission
from mci.server.tool_calls import ToolPlan


@dataclass(frozen=True)
class StreamContext:
    """One streamed request: where its outputs come from and what its chunks must say.

    `prompts` holds (the prompt as the client gave it, its token ids) per prompt; choice i
    belongs to prompt i // params.n.
    """

    state: ServerState
    submission: Submission
    request_id: str
    prompts: list[tuple[str | list[int] | None, list[int]]]
    params: SamplingParams
    echo: bool = False
    include_usage: bool = False
    tools: ToolPlan | None = None  # chat with callable tools: text held back until the end
    reasoning: bool = False  # chat: split reasoning_content off (--reasoning-parser)
    return_token_ids: bool = False  # each chunk's choice carries its new token ids
    resumed_tokens: int = 0  # output tokens generated before a resumed request (usage)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(ids) for _, ids in self.prompts)


def sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


async def streaming_response(
    gen: AsyncIterator[str], ctx: StreamContext, request: Request
) -> ClosingStreamingResponse:
    """The SSE response, sent once the request has started: a request refused before its
    first output (e.g. it waited past --max-queue-time) still gets its HTTP status."""
    await ctx.submission.wait_started(request)
    # client gone or stream done: nothing may keep running in the engine
    return ClosingStreamingResponse(
        gen,
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache"},
        on_close=ctx.submission.abort,
    )


async def _reportable(
    sub: Submission, usage: list[int], with_ids: bool = False
) -> AsyncIterator[RequestOutput]:
    """Outputs worth a chunk (new text, prompt logprobs, the end, an error, or new tokens
    when chunks carry token ids); counts tokens into usage[0], cached prompt tokens into
    usage[1]."""
    while sub.remaining:
        out = await sub.next()
        usage[0] += len(out.new_token_ids)
        usage[1] = max(usage[1], out.num_cached_tokens)
        worth = out.delta_text or out.new_logprobs or out.finished or out.prompt_logprobs
        if out.error or worth or (with_ids and out.new_token_ids):
            yield out
            if out.error:
                return


def _usage_chunk(base: dict, prompt_tokens: int, usage: list[int]) -> str:
    """The final chunk of `stream_options.include_usage`: no choices, just usage."""
    body = responses.usage(prompt_tokens, usage[0], usage[1])
    return sse({**base, "choices": [], "usage": body})


def stream_error(out: RequestOutput) -> str:
    """An error event; code `engine_died` when the engine's death ended the request (the
    router continues such a stream on another replica)."""
    code = "engine_died" if out.error in ENGINE_DEATH_ERRORS else None
    return sse(error_body(out.error or "request failed", "server_error", code=code))


async def stream_completion(ctx: StreamContext) -> AsyncIterator[str]:
    """Completion chunks. With echo, a choice's first chunk is its prompt (and the prompt's
    logprobs, when asked), sent once the engine has scored it; `text_offset` always indexes
    the choice's whole text so far."""
    created, usage = int(time.time()), [ctx.resumed_tokens, 0]
    sub, params, tokenizer = ctx.submission, ctx.params, ctx.state.tokenizer
    base = {
        "id": ctx.request_id,
        "object": "text_completion",
        "created": created,
        "model": ctx.state.model_name,
    }
    offsets: dict[int, int] = {}  # choice index -> characters of its text so far

    def chunk(idx: int, text: str, logprobs, reason, token_ids=()) -> str:
        choice = {"index": idx, "text": text, "logprobs": logprobs, "finish_reason": reason}
        if ctx.return_token_ids:
            choice["token_ids"] = list(token_ids)
        return sse({**base, "choices": [choice]})

    async for out in _reportable(sub, usage, ctx.return_token_ids):
        if out.error:
            yield stream_error(out)
            break
        idx = sub.index[out.request_id]
        if idx not in offsets:
            offsets[idx] = 0
            if ctx.echo:
                prompt, ids = ctx.prompts[idx // params.n]
                text = responses.echo_text(tokenizer, prompt, ids)
                offsets[idx] = len(text)
                yield chunk(idx, text, responses.echo_logprobs(tokenizer, ids, out), None)
        lp = None
        if params.logprobs is not None:
            lp, offsets[idx] = responses.completion_logprobs(
                tokenizer, out.new_token_ids, out.new_logprobs, offsets[idx]
            )
        if out.delta_text or out.new_token_ids or out.finished:
            yield chunk(idx, out.delta_text, lp, responses.finish_reason(out), out.new_token_ids)
    if ctx.include_usage:
        yield _usage_chunk(base, ctx.num_prompt_tokens, usage)
    yield sse("[DONE]")


async def stream_chat(ctx: StreamContext) -> AsyncIterator[str]:
    """Chat chunks: a role chunk per choice, then content deltas."""
    created, usage = int(time.time()), [ctx.resumed_tokens, 0]
    sub = ctx.submission
    base = {
        "id": ctx.request_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": ctx.state.model_name,
    }
    for idx in sub.index.values():
        yield sse(
            {
                **base,
                "choices": [
                    {
                        "index": idx,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ],
            }
        )
    held: dict[str, str] = {}  # with tools: a sample's text, until it is known not a call
    splitters: dict[str, ReasoningStream] = {}
    async for out in _reportable(sub, usage, ctx.return_token_ids):
        if out.error:
            yield stream_error(out)
            break
        lp = None
        if out.new_logprobs:
            lp = responses.chat_logprobs(ctx.state.tokenizer, out.new_token_ids, out.new_logprobs)
        delta = {"content": out.delta_text} if out.delta_text else {}
        reason = responses.finish_reason(out)
        if ctx.reasoning and ctx.tools is None:
            splitter = splitters.setdefault(out.request_id, ReasoningStream())
            thought, said = splitter.feed(out.delta_text, out.finished)
            delta = {"reasoning_content": thought} if thought else {}
            if said:
                delta["content"] = said
        if ctx.tools is not None:
            held[out.request_id] = held.get(out.request_id, "") + out.delta_text
            delta = {}
            if out.finished:
                full = dataclasses.replace(out, text=held[out.request_id])
                message, reason = responses.chat_message(full, ctx.tools, ctx.reasoning)
                if message["content"]:
                    delta = {"content": message["content"]}
                if "tool_calls" in message:
                    delta["tool_calls"] = [
                        {"index": i, **call} for i, call in enumerate(message["tool_calls"])
                    ]
                if message.get("reasoning_content"):
                    delta["reasoning_content"] = message["reasoning_content"]
        yield sse(
            {
                **base,
                "choices": [
                    {
                        "index": sub.index[out.request_id],
                        "delta": delta,
                        "logprobs": lp,
                        "finish_reason": reason,
                        **({"token_ids": out.new_token_ids} if ctx.return_token_ids else {}),
                    }
                ],
            }
        )
    if ctx.include_usage:
        yield _usage_chunk(base, ctx.num_prompt_tokens, usage)
    yield sse("[DONE]")


async def stream_native(ctx: StreamContext) -> AsyncIterator[str]:
    """SGLang's native stream: each event carries the sample's whole text so far."""
    sub = ctx.submission
    texts: dict[str, str] = {}
    while sub.remaining:
        out = await sub.next()
        if out.error:
            yield stream_error(out)
            break
        texts[out.request_id] = texts.get(out.request_id, "") + out.delta_text
        yield sse(
            {
                "index": sub.index[out.request_id],
                "text": texts[out.request_id],
                "meta_info": {
                    "id": out.request_id,
                    "finish_reason": responses.native_finish_reason(out),
                    "completion_tokens": None,
                },
            }
        )
    yield sse("[DONE]")
