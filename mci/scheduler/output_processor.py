"""Turns sampled tokens into outputs: stop checks, incremental text, stop strings.

Stop strings are matched on the decoded text, so they work across token boundaries, and are
cut from the output. While a request runs, the last (longest stop string - 1) characters are
held back, so a streaming client never sees the start of a stop string that completes later:
the concatenated deltas always equal the final text.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from mci.core.outputs import RequestOutput
from mci.core.request import Request, RequestStatus
from mci.scheduler.detokenizer import IncrementalDetokenizer
from mci.tokenizer import TextTokenizer

log = logging.getLogger("mci")


@dataclass
class _TextState:
    detokenizer: IncrementalDetokenizer
    text: str = ""
    emitted: int = 0  # characters of `text` already sent
    holdback: int = 0


class OutputProcessor:
    """Per-request text state; decides when a request is finished."""

    def __init__(
        self, tokenizer: TextTokenizer, eos_ids: tuple[int, ...], jump_forward: bool = False
    ):
        self._tokenizer = tokenizer
        self._eos_ids = frozenset(eos_ids)
        self._states: dict[str, _TextState] = {}
        self.jump_forward = jump_forward

    def add(self, req: Request) -> None:
        holdback = max((len(s) for s in req.params.stop), default=1) - 1
        p = req.params
        detok = IncrementalDetokenizer(self._tokenizer, p.skip_special_tokens, len(p.healed_text))
        state = _TextState(detok, holdback=holdback)
        if req.output_ids:  # resumed: the text so far, of which the first part was delivered
            # token by token, as `_append` decoded them where they were generated: decoding
            # them at once can place a broken UTF-8 sequence's U+FFFD differently
            state.text = "".join(detok.step([token]) for token in req.output_ids)
            state.emitted = min(req.resumed_text_offset, len(state.text))
        self._states[req.request_id] = state

    def on_tokens(self, req: Request, tokens: list[int], logprobs: list) -> RequestOutput:
        """Append a step's new tokens in order (one, or several verified at once), applying
        every stop rule after each: tokens after the one that finishes the request are
        dropped. Reports the step's delta, one output for all of them."""
        appended = []
        for token, logprob in zip(tokens, logprobs, strict=True):
            self._append(req, token, logprob)
            appended.append(token)
            if req.is_finished:
                break
        if self.jump_forward and not req.is_finished and req.grammar is not None:
            for token in self._forced_tokens(req):
                self._append(req, token, None)
                appended.append(token)
                if req.is_finished:
                    break
        return self._output(req, appended)

    def _forced_tokens(self, req: Request) -> list[int]:
        """Jump-forward: the tokens of the text the grammar admits as the only continuation
        (tokenised on their own), if the grammar accepts that tokenisation; none for a
        request that wants logprobs (forced tokens have none)."""
        if req.params.logprobs is not None:
            return []
        matcher = req.grammar.matcher
        text = matcher.find_jump_forward_string()
        if not text:
            return []
        ids = self._tokenizer.encode(text, add_bos=False)
        accepted = 0
        for token in ids:
            if not matcher.accept(token):
                break
            accepted += 1
        matcher.rollback(accepted)  # `_append` accepts them again, one by one
        return ids if accepted == len(ids) else []

    def _append(self, req: Request, token: int, logprob) -> None:
        state = self._states[req.request_id]
        p = req.params
        req.append_token(token)
        if logprob is not None:
            req.logprobs.append(logprob)
        if req.grammar is not None and self._grammar_ends(req, token):
            self._finish(req, "stop", None)
        elif token in p.stop_token_ids:
            self._finish(req, "stop", token)
        elif token in self._eos_ids and not p.ignore_eos:
            self._finish(req, "stop", None)
        else:
            old_len = len(state.text)
            state.text += state.detokenizer.step([token])
            # A stop string can only complete inside the new text or straddle its start.
            hits = [
                (at, stop)
                for stop in p.stop
                if (at := state.text.find(stop, max(old_len - len(stop) + 1, 0))) != -1
            ]
            if hits:
                at, stop = min(hits)
                state.text = state.text[:at]
                self._finish(req, "stop", stop)
        if not req.is_finished and len(req.output_ids) >= p.max_new_tokens:
            self._finish(req, "length", None)
        if not req.is_finished and req.prefill_only:  # the decode side goes on from here
            self._finish(req, "length", None)

    @staticmethod
    def _grammar_ends(req: Request, token: int) -> bool:
        """Advance the request's grammar by its new token; True once the grammar has taken its
        end (its output is complete). A token the mask allowed is always accepted; one that
        is not (a bug) ends the request rather than emit output that breaks its grammar."""
        matcher = req.grammar.matcher
        if not matcher.accept(token):
            log.error("%s: token %d breaks its grammar; ending it", req.request_id, token)
            return True
        return matcher.is_terminated()

    def on_prompt_only(self, req: Request) -> RequestOutput:
        """A request with max_new_tokens = 0 has computed (and scored) its prompt."""
        self._finish(req, "length", None)
        return self._output(req, [])

    def on_abort(self, req: Request, error: str | None = None) -> RequestOutput:
        """The final output of an aborted request (client abort, deadline, shutdown)."""
        req.status = RequestStatus.ABORTED
        req.finish_reason = "abort"
        out = self._output(req, [])
        out.error = error
        return out

    def _finish(self, req: Request, reason: str, stop_reason) -> None:
        req.status = RequestStatus.FINISHED
        req.finish_reason, req.stop_reason = reason, stop_reason
        state = self._states[req.request_id]
        if not (reason == "stop" and isinstance(stop_reason, str)):
            state.text += state.detokenizer.flush()

    def _output(self, req: Request, new_ids: list[int]) -> RequestOutput:
        state = self._states[req.request_id]
        end = len(state.text) if req.is_finished else max(len(state.text) - state.holdback, 0)
        end = max(end, state.emitted)
        delta = state.text[state.emitted : end]
        state.emitted = end
        if req.is_finished:
            del self._states[req.request_id]
        return RequestOutput(
            request_id=req.request_id,
            new_token_ids=new_ids,
            delta_text=delta,
            finished=req.is_finished,
            finish_reason=req.finish_reason,
            stop_reason=req.stop_reason,
            output_token_ids=list(req.output_ids) if req.is_finished else [],
            text=state.text if req.is_finished else "",
            num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=req.num_cached_prompt_tokens,
            cached_tokens_details=req.cached_tokens_details,
            logprobs=list(req.logprobs) if req.is_finished else [],
            new_logprobs=req.logprobs[len(req.logprobs) - len(new_ids) :] if req.logprobs else [],
            # with the first token (streams echo the prompt then) and with the final output
            prompt_logprobs=req.prompt_logprobs
            if req.is_finished or len(req.output_ids) == len(new_ids)
            else None,
            queue_time_s=None
            if req.first_scheduled_time is None
            else req.first_scheduled_time - req.arrival_time,
        )
