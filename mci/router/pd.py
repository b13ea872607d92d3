"""Prefill-decode pairs (`mci router --pd-disaggregation --prefill URL... --decode URL...`).

Each attempt pairs a decode worker (the caller's choice: the least loaded) with a prefill
worker (cache-aware over the prefill workers' own prompt trees) and sends them the request
at once, under one room:

    router ──body + room──────────────────> prefill worker  computes the prompt, samples the
       │                                      first token, holds the KV   (its answer: unused)
       └──body + room + prefill's bootstrap─> decode worker   reserves slots, reads the KV and
                                               the first token from the prefill worker, decodes:
                                               its answer, streamed or not, is the client's

A prefill worker that refuses or fails (its answer is an error, its connection drops, the
decode worker reports a failed transfer) costs the decode worker nothing: the attempt is made
again with another prefill worker and the same decode worker may take it. A prefill worker's
own client error (a 400) is the client's answer. With no prefill worker available, a decode
worker serves the request alone (it prefills itself: slower, never down).
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid

import httpx

from mci.router.prefix_tree import PrefixTree
from mci.router.workers import Worker, WorkerPool

log = logging.getLogger("mci")

ROOM_HEADER = "X-Mci-Bootstrap-Room"
ADDR_HEADER = "X-Mci-Bootstrap-Addr"
TRANSFER_FAILED = "KV transfer failed"  # what a decode worker's error says when its prefill
# worker failed it (mci/disaggregation/decode_side.py)


class PrefillFailed(Exception):
    """The attempt's prefill worker failed it; `client_error`: its answer when it is the
    client's own error (then no other prefill worker would do better)."""

    def __init__(self, worker: Worker, why: str, client_error: httpx.Response | None = None):
        super().__init__(why)
        self.worker = worker
        self.client_error = client_error


def prefill_body(raw: bytes) -> bytes:
    """The prefill worker's copy: not streamed (its answer is only read for errors)."""
    body = json.loads(raw)
    body["stream"] = False
    body.pop("stream_options", None)
    return json.dumps(body).encode()


class PDPairing:
    """The prefill workers and how one is paired with a decode worker for an attempt."""

    def __init__(self, pool: WorkerPool, policy, allowed):
        self.pool = pool
        self.policy = policy  # over the prefill workers (cache-aware: their prompt trees)
        self.allowed = allowed  # (workers, residency) -> the ones it allows
        self.store_trees: dict[str, PrefixTree] = {}
        self.fallbacks = 0  # requests a decode worker served alone (no prefill worker)
        self.prefill_failures = 0

    def choose(self, key, residency, exclude: set[str]) -> Worker | None:
        candidates = [w for w in self.allowed(self.pool.available(exclude), residency)]
        candidates = [w for w in candidates if w.bootstrap]
        if not candidates:
            return None
        worker = self.policy.choose(candidates, key)
        if key:
            worker.prompt_chars += len(key)
            worker.matched_chars += worker.tree.match(key)
            worker.tree.insert(key)
        return worker

    async def open(
        self,
        client: httpx.AsyncClient,
        path: str,
        raw: bytes,
        headers: dict,
        decode: Worker,
        prefill: Worker | None,
    ) -> httpx.Response:
        """Send the attempt to `decode` (with `prefill` as its KV's source, or alone when
        None) and return the decode worker's response, headers read and body not. Raises
        PrefillFailed when the prefill worker failed the attempt, httpx.TransportError when
        the decode worker did."""
        if prefill is None:
            self.fallbacks += 1
            request = client.build_request("POST", decode.url + path, content=raw, headers=headers)
            return await client.send(request, stream=True)
        room = uuid.uuid4().hex
        prefill.in_flight += 1
        prefill_call = asyncio.ensure_future(
            client.post(
                prefill.url + path,
                content=prefill_body(raw),
                headers={**headers, ROOM_HEADER: room},
            )
        )
        prefill_call.add_done_callback(lambda task: self._prefill_ended(task, prefill))
        decode_headers = {**headers, ROOM_HEADER: room, ADDR_HEADER: prefill.bootstrap}
        url = decode.url + path
        request = client.build_request("POST", url, content=raw, headers=decode_headers)
        decode_call = asyncio.ensure_future(client.send(request, stream=True))
        try:
            done, _ = await asyncio.wait(
                {prefill_call, decode_call}, return_when=asyncio.FIRST_COMPLETED
            )
            if prefill_call in done and decode_call not in done:
                self._check(prefill_call, prefill)  # a failed prefill: the decode side waits
            response = await decode_call
        except BaseException:
            await _close(decode_call)
            raise
        if response.status_code == 503:
            detail = (await response.aread()).decode(errors="replace")
            if TRANSFER_FAILED in detail:
                await response.aclose()
                raise PrefillFailed(prefill, f"decode worker {decode.url}: {detail[:200]}")
            # another 503 (the decode worker's own): the caller's retry rules read it again
            await response.aclose()
            response = httpx.Response(503, content=detail.encode(), headers=response.headers)
        return response

    def _check(self, call: asyncio.Future, prefill: Worker) -> None:
        """The prefill worker answered first: fine if 200, else the attempt failed there."""
        try:
            answer = call.result()
        except httpx.TransportError as exc:
            why = f"prefill worker {prefill.url}: {type(exc).__name__}"
            raise PrefillFailed(prefill, why) from None
        if answer.status_code == 200:
            return
        detail = answer.text[:200]
        why = f"prefill worker {prefill.url} answered {answer.status_code}: {detail}"
        if 400 <= answer.status_code < 500 and answer.status_code != 429:
            raise PrefillFailed(prefill, why, client_error=answer)
        raise PrefillFailed(prefill, why)

    def _prefill_ended(self, task: asyncio.Future, prefill: Worker) -> None:
        """A prefill call's end: its load, and its success (a failure is counted by whoever
        acts on it: the router's attempt, which then pairs another prefill worker)."""
        prefill.in_flight -= 1
        if task.cancelled() or task.exception() is not None:
            return
        if task.result().status_code < 500:
            self.pool.succeeded(prefill)
            prefill.requests += 1


async def _close(call: asyncio.Future) -> None:
    """A decode call the attempt gives up: cancelled, or its response closed (either way the
    decode worker sees its client leave and frees the request's slots)."""
    if not call.done():
        call.cancel()
        try:
            await call
        except BaseException:  # noqa: BLE001 - cancelled or failed: closed either way
            return
        return
    if not call.cancelled() and call.exception() is None:
        await call.result().aclose()
