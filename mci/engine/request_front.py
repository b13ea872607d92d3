"""The one way into the engine: a prompt and its SamplingParams become validated `Request`s.

The in-process `Engine`, the HTTP front end and `mci run-batch` all check prompts through a
`RequestFront`, so a prompt is judged by the same rules everywhere (only the context length
differs: a server may serve less than the model's). Callers check before they queue (their
errors are 400s or exceptions, before anything runs); the engine core then turns each
`AddRequest` into one `Request` per sample through its own front (`requests`), on every rank
alike, checking again.
"""

from __future__ import annotations

import dataclasses
import time

from mci.core.request import QueueClock, Request, Resume
from mci.core.request_ids import sample_ids
from mci.core.sampling_params import SamplingParams
from mci.engine.commands import AddRequest
from mci.errors import InvalidParameter
from mci.grammar.cache import GrammarCache
from mci.grammar.healing import heal_prompt, healing_constraint
from mci.tokenizer import TextTokenizer


class RequestFront:
    """Tokenises and validates prompts against one vocabulary and context length, and fans a
    prompt out into one `Request` per sample (ids, seeds, deadline)."""

    def __init__(
        self,
        tokenizer: TextTokenizer,
        vocab_size: int,
        context_length: int,
        grammar: GrammarCache | None = None,
    ):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.context_length = context_length
        self.grammar = grammar

    def encode(self, prompt: str | list[int]) -> list[int]:
        """Token ids of a text prompt (as transformers' tokenizer gives them), or the given ids
        after checking they exist in the vocabulary."""
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(map(int, prompt))
        if not ids:
            raise InvalidParameter("prompt is empty", "prompt")
        # text prompts too: a tokenizer larger than the model's vocabulary is caught here, not
        # by a failed step that takes every request in the batch down with it
        if min(ids) < 0 or max(ids) >= self.vocab_size:
            raise InvalidParameter(f"prompt token ids must be in [0, {self.vocab_size})", "prompt")
        return ids

    def check(self, ids: list[int], params: SamplingParams) -> None:
        """The prompt and its completion fit the context; token ids in `params` exist."""
        if len(ids) + params.max_new_tokens > self.context_length:
            raise InvalidParameter.named(
                "max_new_tokens",
                f"prompt ({len(ids)} tokens) + {{param}} ({params.max_new_tokens}) exceeds the "
                f"context length {self.context_length}",
                code="context_length_exceeded",
            )
        params.check_vocab(self.vocab_size)

    def check_resume(self, params: SamplingParams, resume: Resume) -> None:
        """A resumed output must be one sample's, unconstrained, in the vocabulary, and shorter
        than max_new_tokens (400s otherwise)."""
        problems = (
            (params.n != 1, "n must be 1"),
            (params.constraint is not None, "an output constraint cannot be resumed"),
            (not resume.output_ids, "there is no output to resume from"),
            (len(resume.output_ids) >= params.max_new_tokens, "the output is already complete"),
            (any(not 0 <= t < self.vocab_size for t in resume.output_ids), "unknown token ids"),
            (resume.text_offset < 0, "the text offset must be >= 0"),
        )
        for bad, why in problems:
            if bad:
                raise InvalidParameter(f"resume_output_token_ids: {why}", "resume_output_token_ids")

    def heal(
        self, ids: list[int], params: SamplingParams, asked: bool = True
    ) -> tuple[list[int], SamplingParams]:
        """Token healing (mci/grammar/healing.py): the prompt backed off by its healed tail,
        and params whose constraint makes the output start with that text. Unchanged when
        there is nothing to heal. A request that cannot be healed (it has an output constraint
        or wants logprobs) is a 400 when it `asked`, and left as it is when healing is only a
        server default."""
        conflict = None
        if params.constraint is not None:
            conflict = "an output constraint"
        elif params.logprobs is not None:
            conflict = "logprobs (the first tokens also spell the healed prompt text)"
        if conflict is not None and asked:
            raise InvalidParameter(
                f"token_healing cannot be combined with {conflict}", "token_healing"
            )
        if conflict is not None:
            return ids, params
        kept, text = heal_prompt(self.tokenizer, ids)
        if not text:
            return ids, params
        return kept, dataclasses.replace(
            params, constraint=healing_constraint(text), healed_text=text
        )

    def check_constraint(self, params: SamplingParams) -> None:
        """Compile the output constraint (cached): a malformed or unsupported one is an
        InvalidParameter here, before anything is queued. Blocks while compiling: callers on
        an event loop run it in a thread; the engine process never calls it (its front end
        did)."""
        if params.constraint is None:
            return
        self._check_grammar(params)
        self.grammar.compile_now(params.constraint)

    def _check_grammar(self, params: SamplingParams) -> None:
        if params.constraint is not None and self.grammar is None:
            raise InvalidParameter("structured output is not available here", "response_format")

    def requests(self, command: AddRequest) -> list[Request]:
        """One request per sample of a checked prompt; sample i of a seeded request is seeded
        `seed + i`, so samples differ and each is reproducible. `command.resume` (n = 1 only):
        the output to continue from. The command's time bounds count from now."""
        ids, params = command.prompt_ids, command.params
        self.check(ids, params)
        self._check_grammar(params)
        now = time.monotonic()
        deadline = None if command.timeout_s is None else now + command.timeout_s
        queue_s = command.queue_timeout_s
        # shared by the samples: once one is scheduled, none of them is "queued too long"
        clock = None if queue_s is None else QueueClock(now + queue_s)
        timing = {
            "priority": command.priority,
            "deadline": deadline,
            "queue_clock": clock,
            "share": command.share,
        }
        handoff = command.handoff
        resume = command.resume
        if resume is not None:
            self.check_resume(params, resume)
            req = Request(command.request_id, ids, params, handoff=handoff, **timing)
            for token in resume.output_ids:
                req.append_token(token)
            req.resumed_text_offset = resume.text_offset
            return [req]
        if params.n == 1:
            return [Request(command.request_id, ids, params, handoff=handoff, **timing)]
        # Samples share the prompt: the scheduler defers siblings until the first one's prefill
        # is in the prefix cache, then they reuse it.
        return [
            Request(
                sid,
                ids,
                dataclasses.replace(
                    params, n=1, seed=None if params.seed is None else params.seed + i
                ),
                handoff=None if handoff is None else handoff.for_sample(i, params.n),
                **timing,
            )
            for i, sid in enumerate(sample_ids(command.request_id, params.n))
        ]
