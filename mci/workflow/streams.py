"""Streams between steps.

`pipe` runs a producer (a streaming step, a model's token stream) in its own task, at most
`buffer` items ahead of its consumer: the consumer starts on the first item while the producer
goes on, and a slow consumer stops the producer at `buffer` items instead of letting it queue
without limit. Whatever ends the consumer (done, an error, cancellation) cancels the producer,
and a producer's error reaches the consumer after the items before it.

`segments` regroups a text stream (deltas of any size) into sentences or lines, so the next
step can start on a whole unit while the rest is still being written.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from contextlib import aclosing

_END = object()
_SENTENCE_END = re.compile(r"[.!?](?:\s+|$)")


class _Raised:
    def __init__(self, exc: BaseException):
        self.exc = exc


async def pipe(source: AsyncIterator, buffer: int) -> AsyncIterator:
    """Yield `source`'s items, produced concurrently at most `buffer` ahead (see module)."""
    queue: asyncio.Queue = asyncio.Queue(maxsize=buffer)

    async def produce() -> None:
        try:
            async for item in source:
                await queue.put(item)
            await queue.put(_END)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            await queue.put(_Raised(exc))
        finally:
            # closed in this task, where it ran: a generator's context managers (a step's
            # call context, its span) must unwind in the context they were entered in
            aclose = getattr(source, "aclose", None)
            if aclose is not None:
                await aclose()

    producer = asyncio.ensure_future(produce())
    try:
        while True:
            item = await queue.get()
            if item is _END:
                return
            if isinstance(item, _Raised):
                raise item.exc
            yield item
    finally:
        producer.cancel()
        try:
            await producer
        except BaseException:  # noqa: BLE001, S110 - its error was handed over or is moot
            pass


async def segments(text: AsyncIterator[str], by: str = "sentence") -> AsyncIterator[str]:
    """Whole sentences (ending in . ! or ? and a space) or lines (ending in a newline, which
    is kept) of a stream of text deltas; what is left at the end comes last."""
    if by not in ("sentence", "line"):
        raise ValueError("segments: by is 'sentence' or 'line'")
    held = ""
    async with aclosing(text):
        async for delta in text:
            held += delta
            while True:
                if by == "line":
                    cut = held.find("\n") + 1
                else:
                    match = _SENTENCE_END.search(held)
                    # a sentence ends where its trailing space does, once more text follows it
                    cut = match.end() if match and match.end() < len(held) else 0
                if cut <= 0:
                    break
                yield held[:cut]
                held = held[cut:]
    if held:
        yield held
