"""A request's state inside the engine: tokens, accounting, KV slots, sampler state.

Token accounting, not phases: a request has `num_tokens` known tokens (prompt + generated)
and `num_computed_tokens` of them have latents in the KV cache. Each step the scheduler gives
it `num_new` tokens to compute; when all known tokens are computed, the step also samples the
next token. Chunked prefill, prefix-cache hits and recomputation after preemption are all
just different values of `num_computed_tokens`.

    token_ids: [ p0 p1 p2 p3 p4 | o0 o1 ]       prompt | output
    slots:     [ s  s  s  s  s  | s  s ]        a slot per computed (or scheduled) token
               <- cached_len ->                 leading slots owned by the radix tree (locked)
               <------ num_slots ----------->   the rest are the request's own
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import time
from dataclasses import dataclass, field

import torch

from mci.core.sampling_params import SamplingParams
from mci.tenancy.tenants import DEFAULT_TENANT


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"


_arrival_counter = itertools.count()


@dataclass(frozen=True)
class Resume:
    """A request continued from output another engine generated (the router resumes a stream
    whose replica died): `output_ids` count as this request's own output (penalties, seeds,
    max_new_tokens, stop rules see them; they are prefilled like a preempted request's), and
    the first `text_offset` characters of their text were already delivered."""

    output_ids: tuple[int, ...]
    text_offset: int


@dataclass(frozen=True)
class TenantShare:
    """Whose a request is, as the scheduler needs it: the tenant's name, its weight under the
    fair policy, and how many of its requests may run at once (None: no bound of its own)."""

    tenant: str = DEFAULT_TENANT
    weight: float = 1.0
    max_running: int | None = None


@dataclass(frozen=True)
class KVHandoff:
    """Prefill-decode disaggregation (mci/disaggregation/): this request's KV crosses between
    two engines, which both know it as `room` (a name the router gave it).

    `source` None: this engine is the prefill side. It computes the known tokens, samples the
    first new token, then holds their KV until the decode side has read it.
    `source` "host:port" (the prefill engine's bootstrap server): this engine is the decode
    side. It reserves slots for the known tokens, reads their KV and the first token from
    there, and decodes."""

    room: str
    source: str | None = None

    @property
    def prefill_only(self) -> bool:
        return self.source is None

    def for_prompt(self, k: int) -> KVHandoff:
        """Prompt `k` of a request: a room of its own (both sides number prompts alike)."""
        return dataclasses.replace(self, room=f"{self.room}-p{k}")

    def for_sample(self, index: int, n: int) -> KVHandoff:
        """Sample `index` of `n`: a room of its own (both sides fan out alike)."""
        return self if n == 1 else dataclasses.replace(self, room=f"{self.room}/{index}")


@dataclass(eq=False)
class QueueClock:
    """A queue deadline (time.monotonic()) that stops counting once a sample is scheduled."""

    deadline: float
    started: bool = False

    def expired(self, now: float) -> bool:
        return not self.started and self.deadline < now


@dataclass(eq=False)
class Request:
    """One sequence being generated. Mutated only by the scheduler thread."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    priority: int = 0  # smaller runs first (vLLM's convention)
    deadline: float | None = None  # time.monotonic() after which the request is aborted
    # --max-queue-time: shared by a prompt's samples, so that once one is scheduled none of
    # its siblings (deferred behind its prefill) is ended as "queued too long"
    queue_clock: QueueClock | None = None
    share: TenantShare = TenantShare()  # its tenant (fair scheduling, per-tenant caps)
    handoff: KVHandoff | None = None  # prefill-decode disaggregation: which side, which room
    # --- state -----------------------------------------------------------------------------
    output_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: str | int | None = None  # the stop string or stop token that ended it
    num_preemptions: int = 0
    num_cached_prompt_tokens: int = 0  # prompt tokens served from the prefix cache (first time)
    # of those, the tokens loaded from each lower cache tier ("host", "storage"), summed over
    # the matches up to its first admission (KVCacheManager.match); then in
    # `cached_tokens_details`
    tier_tokens: dict | None = None
    cached_tokens_details: dict | None = None
    # --- KV ----------------------------------------------------------------------------------
    slots: torch.Tensor = field(default=None)  # [capacity] slot of each position
    num_slots: int = 0  # positions with a slot: num_computed_tokens, plus this step's new ones
    cached_len: int = 0  # leading positions whose slots the radix tree owns
    last_node: object = None  # radix node locked by this request (cached_len tokens deep)
    # --- speculative decoding ----------------------------------------------------------------
    # Tokens proposed to follow `token_ids`, verified (and dropped) by the next step; never
    # part of `token_ids`, never in the KV accounting until verified.
    draft_ids: list[int] = field(default_factory=list)
    # MTP drafting: the main model's state at the last computed position, whose MTP latent
    # waits for the next position's slot (see mci/speculative/mtp.py); dropped with the KV.
    mtp_pending: torch.Tensor | None = None
    # The tree's slot of the position a prefix match left to compute again (`match_margin`),
    # kept alive by the request's lock until its first step copies that slot's MTP latent.
    matched_next_slot: int | None = None
    # --- resumed output ----------------------------------------------------------------------
    # characters of the output's text delivered before this request (see `Resume`)
    resumed_text_offset: int = 0
    # --- structured output ---------------------------------------------------------------------
    # The request's grammar (mci.grammar.cache.GrammarState) when its params carry a
    # constraint: admitted once compiled; its matcher has accepted exactly `output_ids`.
    grammar: object = None
    # --- sampling ----------------------------------------------------------------------------
    generator: torch.Generator = field(default=None)
    token_counts: torch.Tensor | None = None  # [vocab] output-token counts, for penalties
    logprobs: list = field(default_factory=list)  # per output token: (logprob, [(id, lp), ...])
    # Per prompt position, when params.prompt_logprobs is set: None for the first token (it has
    # no context), then (logprob, [(id, lp), ...]). Filled in order as prefill chunks run.
    prompt_logprobs: list | None = None
    # --- timing ------------------------------------------------------------------------------
    arrival_time: float = field(default_factory=time.monotonic)
    arrival_seq: int = field(default_factory=lambda: next(_arrival_counter))
    first_scheduled_time: float | None = None

    def __post_init__(self):
        self.token_ids: list[int] = list(self.prompt_ids) + list(self.output_ids)
        capacity = len(self.prompt_ids) + self.params.max_new_tokens
        self.slots = torch.empty(capacity, dtype=torch.long)
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]
        # logit_bias as tensors once, not per step
        self.bias_ids = torch.tensor([t for t, _ in self.params.logit_bias], dtype=torch.long)
        self.bias_values = torch.tensor([b for _, b in self.params.logit_bias])
        self.generator = torch.Generator()
        # Drawn once: an unseeded request samples from a random seed of its own.
        self.sample_seed = (
            self.params.seed if self.params.seed is not None else self.generator.seed()
        )

    def generator_for_output(self, position: int) -> torch.Generator:
        """The random stream of output token `position`: a function of the seed and of that
        position only, so a seeded request draws the same tokens whatever its batch, however
        often it was preempted, wherever it resumes, and whether its tokens were verified one
        at a time or several per step (a draw never depends on how many draws came before)."""
        # splitmix64-style mixing: nearby (seed, position) pairs get unrelated streams
        mixed = (self.sample_seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9) % 2**64
        return self.generator.manual_seed((mixed ^ (mixed >> 31)) % 2**63)

    def append_token(self, token_id: int) -> None:
        """Record a generated token (it has no latent in the cache yet)."""
        self.output_ids.append(token_id)
        self.token_ids.append(token_id)

    def logits_as_they_come(self, output_position: int) -> bool:
        """Whether output token `output_position` is drawn from the model's logits as they
        come: no logit_bias, penalties, grammar mask, or stop tokens masked before
        min_tokens (runner/sampler.py skips its passes over such a row)."""
        p = self.params
        return not (
            p.logit_bias
            or p.has_penalties
            or output_position < p.min_new_tokens
            or self.grammar is not None
        )

    @property
    def greedy_as_is(self) -> bool:
        """Its next tokens are its logits' first maxima as they come (from here on: greedy,
        its logits as they come past min_tokens), and nothing but the tokens is reported (no
        logprobs) or verified (no drafts)."""
        p = self.params
        return (
            p.greedy
            and p.logprobs is None
            and not self.draft_ids
            and self.logits_as_they_come(len(self.output_ids))
        )

    @property
    def prefill_only(self) -> bool:
        """The prefill side of a disaggregated pair: done once its first new token is out."""
        return self.handoff is not None and self.handoff.prefill_only

    @property
    def receives_kv(self) -> bool:
        """The decode side of a disaggregated pair: its known tokens' KV is read, not computed."""
        return self.handoff is not None and not self.handoff.prefill_only

    @property
    def scores_prompt(self) -> bool:
        """Prompt positions still need their logprobs: the prefix cache must not skip them."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_uncomputed(self) -> int:
        """Known tokens whose latents are not cached yet (1 for a decoding request)."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def own_slots(self) -> torch.Tensor:
        """Slots this request owns (not the tree's)."""
        return self.slots[self.cached_len : self.num_slots]

    @property
    def is_finished(self) -> bool:
        return self.status in (RequestStatus.FINISHED, RequestStatus.ABORTED)

    @property
    def max_total_tokens(self) -> int:
        return len(self.prompt_ids) + self.params.max_new_tokens
