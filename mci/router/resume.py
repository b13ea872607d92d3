"""Resumable streams: when a replica dies mid-stream, the router continues the stream on
another replica and the client sees one unbroken stream: no error, no text twice, none lost,
one `usage` at the end.

The router asks the replica for each chunk's token ids (`return_token_ids`) and counts the
text it has delivered. When the stream breaks (the connection drops, or the replica sends an
error event because its engine died), it sends the same request to another replica with
`resume_output_token_ids` (every token generated so far) and `resume_text_offset` (the
characters delivered). That replica prefills prompt + those tokens and continues: the tokens
count as its output, so max_tokens, penalties, stop rules and the per-position seeds see what
one replica would have seen, and text held back (a possible stop string, a split UTF-8
character) comes out exactly once. Greedy and seeded streams continue with the very tokens one
replica would have given; an unseeded stream continues with a fresh valid sample.

Resumable: completions and chat streams with n = 1 and no output constraint. Others relay
as they are, and a break ends them with an error event.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import httpx

CONSTRAINT_FIELDS = (
    "response_format",
    "regex",
    "guided_regex",
    "choice",
    "guided_choice",
    "ebnf",
    "guided_grammar",
    "guided_json",
)
MAX_RESUMES = 3


class StreamRelay:
    """One client stream, possibly served by several replicas in turn."""

    def __init__(self, path: str, body: dict):
        self.path = path
        self.body = body
        self.client_wants_ids = bool(body.get("return_token_ids"))
        self.token_ids: list[int] = []
        self.delivered = 0  # characters of output text sent to the client
        self.stream_id: str | None = None  # the first replica's id, kept for every chunk
        self.finished = False  # [DONE] relayed
        self.ended = False  # the choice's finish_reason relayed: nothing left to resume
        self.resumable = True  # False once a chunk shows what a resume cannot restore
        # completions with echo: the first chunk is the prompt, not output text
        self.echo_pending = path == "/v1/completions" and bool(body.get("echo"))

    @classmethod
    def maybe(cls, path: str, body: dict) -> StreamRelay | None:
        if path not in ("/v1/completions", "/v1/chat/completions"):
            return None
        if (body.get("n") or 1) != 1 or any(body.get(f) is not None for f in CONSTRAINT_FIELDS):
            return None
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                return None  # several prompts: several choices
        if body.get("tools") and body.get("tool_choice") not in (None, "none", "auto"):
            return None  # a constrained tool call
        if body.get("token_healing"):
            return None  # the replica backed its prompt off: the router cannot repeat that
        return cls(path, body)

    def first_body(self) -> bytes:
        return json.dumps({**self.body, "return_token_ids": True}).encode()

    def resume_body(self) -> bytes:
        body = {
            **self.body,
            "return_token_ids": True,
            "resume_output_token_ids": self.token_ids,
            "resume_text_offset": self.delivered,
        }
        if self.path == "/v1/completions":
            body["echo"] = False  # the prompt was echoed already
        return json.dumps(body).encode()

    async def run(
        self, router, path, key, headers, worker, upstream, span=None, *, residency
    ) -> AsyncIterator[bytes]:
        """The client's stream over replicas in turn; each hop is sent with `headers` (the
        request's `span` as its traceparent), and `span` counts the resumes. A resumed hop
        goes only where the request's `residency` allows, as its first one did."""
        resumes = 0
        while True:
            broken = None
            try:
                async for event in self._relay(upstream, resumed=resumes > 0):
                    yield event
            except httpx.TransportError as exc:
                broken = f"{type(exc).__name__}"
            finally:
                await upstream.aclose()
                worker.in_flight -= 1
            if self.finished:
                return
            if self.ended:  # only [DONE] was missing
                yield b"data: [DONE]\n\n"
                return
            broken = broken or "the stream ended early"
            router.pool.failed(worker)
            opened = None
            if resumes < MAX_RESUMES and self.resumable:
                # nothing generated yet: a plain retry is exact
                body = self.resume_body() if self.token_ids else self.first_body()
                opened = await router.open(
                    path, body, key, headers, {worker.url}, span, residency=residency
                )
                if isinstance(opened, tuple) and opened[1].status_code != 200:
                    failed_worker, failed = opened
                    await failed.aclose()
                    failed_worker.in_flight -= 1
                    opened = None
            if not isinstance(opened, tuple):
                router.metrics.resume_failed.inc()
                message = f"replica {worker.url} failed mid-stream ({broken}); could not resume"
                if span is not None:
                    span.failed(message)
                yield _sse({"error": {"message": message, "type": "server_error"}})
                yield b"data: [DONE]\n\n"
                return
            router.metrics.resumed.inc()
            resumes += 1
            if span is not None:
                span.resumes = resumes
            worker, upstream = opened

    async def _relay(self, upstream: httpx.Response, resumed: bool) -> AsyncIterator[bytes]:
        """The replica's events, rewritten for the client; sets `finished` at [DONE]. Stops
        (without raising) at an error event: the replica's engine died."""
        async for line in upstream.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: ") :]
            if data == "[DONE]":
                self.finished = True
                yield b"data: [DONE]\n\n"
                return
            chunk = json.loads(data)
            error = chunk.get("error")
            if error is not None:
                if isinstance(error, dict) and error.get("code") == "engine_died":
                    return  # the replica's engine died: the caller continues elsewhere
                self.finished = True  # the request's own error: the client's to see
                yield _sse(chunk)
                yield b"data: [DONE]\n\n"
                return
            event = self._rewrite(chunk, resumed)
            if event is not None:
                yield _sse(event)

    def _rewrite(self, chunk: dict, resumed: bool) -> dict | None:
        self.stream_id = self.stream_id or chunk.get("id")
        chunk["id"] = self.stream_id
        for choice in chunk.get("choices") or []:
            self.token_ids.extend(choice.get("token_ids") or [])
            if choice.get("finish_reason") is not None:
                self.ended = True
            if not self.client_wants_ids:
                choice.pop("token_ids", None)
            delta = choice.get("delta")
            if delta is not None:  # chat
                if resumed:
                    delta.pop("role", None)
                if delta.get("reasoning_content"):
                    # the server's reasoning split drops `</think>` and newlines from the text:
                    # offsets in the engine's text are lost, so this stream cannot resume
                    self.resumable = False
                self.delivered += len(delta.get("content") or "")
                if (
                    resumed
                    and not any(delta.values())
                    and choice.get("finish_reason") is None
                    and not choice.get("logprobs")
                    and not choice.get("token_ids")
                ):
                    return None  # the new replica's role chunk
            elif self.echo_pending:
                self.echo_pending = False
            else:
                self.delivered += len(choice.get("text") or "")
        return chunk


def _sse(payload: dict) -> bytes:
    return f"data: {json.dumps(payload)}\n\n".encode()
