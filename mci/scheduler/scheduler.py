"""The scheduler: request queues, the batching policy, and applying a step's results.

`schedule()` builds one batch per step that mixes the running requests' work (one token for a
decode, the next chunk for a request still prefilling) with newly admitted requests, under a
token budget for prompt work (`max_prefill_tokens`, `chunked_prefill_size`) and
`max_running_requests`. KV slots for the step are allocated before the forward; when they run
out, unlocked prefix cache is evicted first, then the lowest-priority (then newest) running
request is preempted: its slots are freed (its computed prefix stays in the radix tree), any
budget its chunk took goes back to the step, and it is requeued to be recomputed later,
keeping the tokens it already generated. `update(batch, result)` applies what the runner
produced. The scheduler never touches the model: a fake `SampleResult` drives it in tests.

Prefill-decode disaggregation (scheduler/handoff.py): on the prefill side a request ends
once its first new token is out, its KV held for the decode side; on the decode side a request
is admitted into `receiving` (slots reserved, its KV read by the seam, nothing computed) and
joins `running` with its first token when the KV has arrived.

Invariants: a request is in exactly one of `waiting`, `receiving`, `running`, or finished;
every request that enters via `add_request` leaves with exactly one final output (finished or
aborted); the KV integrity check holds between steps.
"""

from __future__ import annotations

import logging
import time
from collections import Counter

from mci.cache.kv_manager import KVCacheManager
from mci.core.batch import SampleResult, ScheduledBatch, ScheduledItem
from mci.core.outputs import QUEUE_TIMEOUT, REQUEST_TIMEOUT, RequestOutput
from mci.core.request import Request, RequestStatus
from mci.scheduler.config import SchedulerConfig
from mci.scheduler.fair_share import VirtualTokenCounter
from mci.scheduler.handoff import (
    HandoffEvent,
    HoldReleased,
    KVArrived,
    KVFailed,
    KVHandoff,
    SlotsSafe,
)
from mci.scheduler.output_processor import OutputProcessor
from mci.scheduler.steps_ahead import steps_ahead

log = logging.getLogger("mci")

LPM_MAX_QUEUE = 128  # beyond this, prefix matching every waiting request costs too much: fcfs
# Under lpm, a request that has waited this long goes before every younger one (in arrival
# order): otherwise, under sustained overload, a prompt sharing no prefix with the traffic
# is passed by every newer one that does, until --max-queue-time ends it (measured: 2 of
# 716,065 soak requests, 372 in 20 min on `small` with the CPUs shared).
LPM_MAX_WAIT_S = 10.0
# Defer a request whose prompt shares at least this many uncached tokens with a prompt still
# being prefilled: once that prefill lands in the radix tree, it reuses it instead.
SHARED_PREFIX_DEFER_TOKENS = 32
# Decode side: KV each decoding request may still grow into, kept free when a request's KV is
# reserved (SGLang's decode side reserves 512 too). A decode worker admits reservations as
# fast as they come (nothing to compute), so without it they would fill the pool and force
# running streams out, to be recomputed: a prefill on the decode worker.
DECODE_HEADROOM_TOKENS = 512


class Scheduler:
    """Owns the request queues and their KV memory; plans steps and applies their results."""

    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCacheManager,
        output_processor: OutputProcessor,
        decode_steps: int | None = None,
    ):
        self.config = config
        self.kv = kv
        self.output_processor = output_processor
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.receiving: dict[str, Request] = {}  # decode side: reserved, KV on its way
        self.handoff: KVHandoff | None = None  # disaggregation's seam (None: colocated)
        self.counters: Counter[str] = Counter()  # transitions and token counts, for metrics
        self.fair = VirtualTokenCounter()  # kept under every policy; `fair` orders by it
        # most decode steps a step may run (`_plan_ahead`): the config's, or what the
        # builder allows (1 where the runner never runs more: drafts, ranks, no CPU kernels)
        self.decode_steps = config.num_scheduler_steps if decode_steps is None else decode_steps
        # requests waiting or running, per tenant: kept as they come and go, so that an
        # arrival does not scan both queues
        self._in_queues: Counter[str] = Counter()

    # ---- intake -------------------------------------------------------------------------------
    def add_request(self, req: Request) -> RequestOutput | None:
        """Queue a request; returns an immediate abort output if it can never fit."""
        self.output_processor.add(req)
        self.counters["requests_added"] += 1
        if req.max_total_tokens > self.kv.pool.num_slots:
            return self._abort(
                req,
                f"request needs {req.max_total_tokens} KV tokens; the pool "
                f"holds {self.kv.pool.num_slots}",
            )
        if req.handoff is not None and self.handoff is None:
            return self._abort(req, "this engine is not a prefill or decode worker")
        if req.prefill_only:
            self.handoff.expect(req)
        self.fair.arrive(req.share.tenant, req.share.weight, self.active_tenants())
        self.waiting.append(req)
        self._in_queues[req.share.tenant] += 1
        return None

    def active_tenants(self) -> set[str]:
        """Tenants with a request waiting or running."""
        return set(self._in_queues)

    def _left_queues(self, req: Request) -> None:
        tenant = req.share.tenant
        self._in_queues[tenant] -= 1
        if self._in_queues[tenant] <= 0:
            del self._in_queues[tenant]

    def abort_request(self, request_id: str) -> RequestOutput | None:
        for queue in (self.running, self.waiting, self.receiving.values()):
            for req in queue:
                if req.request_id == request_id:
                    return self._abort(req, None)
        return None

    @property
    def has_work(self) -> bool:
        busy = self.handoff is not None and self.handoff.busy
        return bool(self.waiting or self.running or self.receiving or busy)

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Share of admitted prompt tokens served from the radix cache (first admissions)."""
        queries = self.counters["prefix_cache_queries"]
        return self.counters["prefix_cache_hits"] / queries if queries else 0.0

    # ---- the step -------------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        """Decide this step's work and allocate its KV slots."""
        batch = ScheduledBatch()
        budget = _Budget(self.config.max_prefill_tokens)
        chunk = self.config.chunk_limit or 1 << 62
        later = []  # fair: prefills of tenants served more than one now waiting
        floor = self._waiting_floor()
        for req in sorted(self.running, key=self._rank):
            if req.num_uncomputed > 1 and self.fair.counter(req.share.tenant) > floor:
                later.append(req)  # the less-served waiting tenant's prompt goes first
                continue
            self._plan_running(req, batch, budget, chunk)
        self._admit(batch, budget, chunk)
        for req in later:
            self._plan_running(req, batch, budget, chunk)
        self._plan_ahead(batch)
        return batch

    def _plan_ahead(self, batch: ScheduledBatch) -> None:
        """Let the step run several decode steps in one call (scheduler/steps_ahead.py) while
        no request waits for admission: slots for the steps ahead, from free ones. A request
        arriving meanwhile waits for the step in flight only: the inbox's wake-up ends the
        call (`StepCore.wake_on`)."""
        if self.waiting or self.receiving or self.handoff is not None:
            return
        steps = steps_ahead(batch.items, self.decode_steps, self.kv.pool.num_free)
        if steps <= 1:
            return
        for item in batch.items:
            if not self.kv.allocate(item.request, steps - 1):  # cannot fail: they are free
                raise RuntimeError(f"KV allocation of {steps - 1} slots failed after the check")
        batch.decode_steps = steps

    def _waiting_floor(self) -> float:
        """Under fair, the lowest counter of a tenant with a request waiting (a running
        prefill of a tenant above it takes the step's prefill budget only after admission);
        otherwise infinity (running requests first, as always)."""
        if self.config.schedule_policy != "fair" or not self.waiting:
            return float("inf")
        return min(self.fair.counter(r.share.tenant) for r in self.waiting)

    def _plan_running(
        self, req: Request, batch: ScheduledBatch, budget: _Budget, chunk: int
    ) -> None:
        """A running request's next work: one decode token (and drafts to verify), or the next
        chunk of its prompt within the step's prefill budget."""
        if req.status is not RequestStatus.RUNNING:
            return  # preempted earlier in this step
        n = req.num_uncomputed
        prefilling = n > 1  # prompt work takes from the budget; a decode token does not
        drafts = () if prefilling else self._drafts_to_verify(req)
        if prefilling:
            n = min(n, chunk, budget.left)
            if n <= 0:
                return
        if not self._allocate_or_preempt(req, n + len(drafts), batch, budget):
            return
        self._plan(batch, req, n + len(drafts), drafts)
        if prefilling:
            budget.charge(req, n)

    def _allocate_or_preempt(
        self, req: Request, n: int, batch: ScheduledBatch, budget: _Budget
    ) -> bool:
        while not self.kv.allocate(req, n):
            victim = max(self.running, key=self._rank)  # under fair: the most served tenant's
            self._preempt(victim, batch, budget)
            if victim is req:
                return False
        return True

    def _admit(self, batch: ScheduledBatch, budget: _Budget, chunk: int) -> None:
        cfg = self.config
        prefilling = _PrefillsInFlight(
            r for r in self.running if r.num_computed_tokens < r.num_prompt_tokens
        )
        for req in self._admission_order():
            if len(self.running) + len(self.receiving) >= cfg.max_running_requests:
                break
            if req.receives_kv:  # nothing to compute: no prefill budget
                if not self._admit_receiving(req):
                    break
                continue
            if budget.left <= 0:
                break
            if req.grammar is not None and not _grammar_ready(req):
                continue  # still compiling: the others go ahead
            if self._tenant_at_cap(req):
                continue  # its tenant runs its most at once: the others go ahead
            self.kv.match(req)
            if self.kv.radix is not None and prefilling.shares(req):
                self.kv.release(req)
                continue
            n = min(req.num_uncomputed, chunk, budget.left)
            reserve = cfg.decode_reserve_tokens * len(self.running)
            if self.kv.available < n + reserve:
                self.kv.release(req)
                break  # keep priority order: nobody behind it jumps the queue
            self._started(req)
            # not an assert: the allocation must happen under `python -O` too
            if not self.kv.allocate(req, n):  # cannot fail: `available` was checked above
                raise RuntimeError(f"KV allocation of {n} slots failed after the check")
            self.waiting.remove(req)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            self._plan(batch, req, n)
            budget.charge(req, n)
            prefilling.add(req)

    def _started(self, req: Request) -> None:
        """A request admitted: its queue clock stops; the first time, its cache report."""
        if req.queue_clock is not None:
            req.queue_clock.started = True
        if req.num_preemptions == 0:
            req.first_scheduled_time = time.monotonic()
            req.num_cached_prompt_tokens = req.cached_len
            req.cached_tokens_details = self.kv.cached_tokens_details(req)
            self.counters["prefix_cache_queries"] += req.num_prompt_tokens
            self.counters["prefix_cache_hits"] += req.cached_len

    def _admit_receiving(self, req: Request) -> bool:
        """Decode side: slots for every known token its own cache does not hold, then the seam
        reads their KV from the prefill side. False when they do not fit now."""
        self.kv.match(req)
        n = req.num_uncomputed
        if self.kv.available < n + self._decode_headroom() + _headroom(req):
            self.kv.release(req)
            return False
        self._started(req)
        if not self.kv.allocate(req, n):  # cannot fail: `available` was checked above
            raise RuntimeError(f"KV allocation of {n} slots failed after the check")
        self.waiting.remove(req)
        self.receiving[req.request_id] = req
        self.counters["kv_transfers_reserved"] += 1
        self.handoff.reserve(req)
        return True

    def _decode_headroom(self) -> int:
        """What the running and receiving requests may still grow into (each capped)."""
        return sum(map(_headroom, self.running)) + sum(map(_headroom, self.receiving.values()))

    def take_handoffs(self) -> list[RequestOutput]:
        """Apply what the disaggregation seam reported since the last step (its threads never
        touch the pool, the tree or the queues); returns the outputs that causes."""
        if self.handoff is None:
            return []
        outputs = []
        for event in self.handoff.poll():
            out = self._apply_handoff(event)
            if out is not None:
                outputs.append(out)
        return outputs

    def _apply_handoff(self, event: HandoffEvent) -> RequestOutput | None:
        if isinstance(event, HoldReleased):
            self.kv.unhold(event.hold_id)
            return None
        if isinstance(event, SlotsSafe):
            self.kv.end_quarantine(event.request_id)
            return None
        req = self.receiving.get(event.request_id)
        if req is None:
            return None  # it ended meanwhile (aborted: the seam was told)
        if isinstance(event, KVFailed):
            del self.receiving[req.request_id]
            self._left_queues(req)
            if not event.slots_safe:
                self.kv.quarantine(req)
            self.kv.release(req)
            self.counters["kv_transfers_failed"] += 1
            self.counters["aborted"] += 1
            return self.output_processor.on_abort(req, event.error)
        return self._kv_arrived(req, event)

    def _kv_arrived(self, req: Request, event: KVArrived) -> RequestOutput:
        """The request's known tokens are computed now (their KV was read): it goes into the
        tree, joins the running batch and takes its first token as if sampled here."""
        del self.receiving[req.request_id]
        req.handoff = None  # from here a request like any other (a preemption recomputes)
        self.counters["kv_transfers_done"] += 1
        self.counters["kv_transfer_tokens"] += req.num_tokens - req.cached_len
        req.num_computed_tokens = req.num_tokens
        req.num_cached_prompt_tokens = event.cached_tokens  # computing was the prefill side's
        self.kv.cache_prefix(req)
        if req.prompt_logprobs is not None and event.prompt_logprobs is not None:
            req.prompt_logprobs = list(event.prompt_logprobs)
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        if req.params.max_new_tokens == 0:  # scoring only: done with its prompt
            out = self.output_processor.on_prompt_only(req)
        else:
            out = self.output_processor.on_tokens(req, list(event.token_ids), list(event.logprobs))
            self.counters["generation_tokens"] += len(out.new_token_ids)
            self.fair.charge(req.share.tenant, 0, len(event.token_ids))
        if req.is_finished:
            self._retire(req)
        return out

    def update(self, batch: ScheduledBatch, result: SampleResult) -> list[RequestOutput]:
        """Apply a step's results: record prompt logprobs, advance token accounting (a prompt
        just completed goes into the prefix cache), append sampled tokens with their stop
        rules, and release finished requests. `result` follows `SampleResult`'s layout."""
        for item, scores in zip(batch.scoring_items, result.prompt_logprobs, strict=True):
            item.request.prompt_logprobs += scores
        outputs = []
        if batch.decode_steps > 1 and result.token_ids:  # steps run past the first in the call
            self.counters["decode_steps_ahead"] += len(result.token_ids[0]) - 1
        for item in batch.items:
            req = item.request
            req.num_computed_tokens += item.num_new - len(item.draft_ids)  # drafts: below
            # prompt positions computed (recomputation after preemption included)
            self.counters["prompt_tokens"] += max(
                0, min(req.num_prompt_tokens, req.num_computed_tokens) - item.start
            )
            if item.start < req.num_prompt_tokens <= req.num_computed_tokens:
                self.kv.cache_prefix(req)  # share the prompt while the request decodes
                if req.params.max_new_tokens == 0:  # scoring only: done with its prompt
                    outputs.append(self.output_processor.on_prompt_only(req))
                    self._retire(req)
        for i, item in enumerate(batch.sampling_items):
            req = item.request
            out = self.output_processor.on_tokens(req, result.token_ids[i], result.logprobs[i])
            outputs.append(out)
            self.counters["generation_tokens"] += len(out.new_token_ids)
            if item.draft_ids:
                self._apply_verification(item, result.num_accepted[i], len(out.new_token_ids))
            elif batch.decode_steps > 1:
                self._keep_steps_ahead(item, len(result.token_ids[i]), len(out.new_token_ids))
            jumped = len(out.new_token_ids) > len(result.token_ids[i])  # drafts no longer fit
            req.draft_ids = list(result.draft_ids[i]) if result.draft_ids and not jumped else []
            if req.is_finished:
                self._retire(req)
        return outputs

    def _drafts_to_verify(self, req: Request) -> tuple[int, ...]:
        """The request's drafts that fit: the verified tokens can never outgrow its slot
        buffer (prompt + max_new_tokens positions), so at most that many minus what it has."""
        room = req.max_total_tokens - req.num_tokens
        return tuple(req.draft_ids[:room]) if room > 0 else ()

    def _apply_verification(self, item: ScheduledItem, accepted: int, appended: int) -> None:
        """Keep the latents of accepted drafts that became tokens, free the rest's slots.

        Position start + j (j >= 1) was computed from draft j; its latent is right iff that
        draft was accepted and appended (the request may have finished earlier in the step)."""
        self._keep_computed(item.request, accepted, appended)
        self.counters["spec_decode_num_drafts"] += 1
        self.counters["spec_decode_num_draft_tokens"] += len(item.draft_ids)
        self.counters["spec_decode_num_accepted_tokens"] += accepted
        for position in range(accepted):
            self.counters[f"spec_decode_num_accepted_tokens_pos_{position}"] += 1

    def _keep_steps_ahead(self, item: ScheduledItem, ran: int, appended: int) -> None:
        """After `ran` decode steps of one call: position start + j (j >= 1) was computed
        from the token step j - 1 drew; keep its latent if that token was appended (the
        request may have finished earlier), and free the slots of the steps not run. Its
        tenant is charged for the tokens it got past the first (`_plan` charged that one)."""
        req = item.request
        self._keep_computed(req, ran - 1, appended)
        self.fair.charge(req.share.tenant, 0, max(0, min(ran, appended) - 1))

    def _keep_computed(self, req: Request, extra: int, appended: int) -> None:
        """The step computed `extra` positions past the item's known tokens, each from the
        token before it: keep those whose token was appended (`appended` of them came out),
        free the rest's slots."""
        req.num_computed_tokens += min(extra, appended)
        self.kv.drop_unverified(req)

    def _retire(self, req: Request) -> None:
        self.counters[f"finished_{req.finish_reason}"] += 1
        if req.prefill_only:  # its KV stays until the decode side has read it
            self.handoff.offer(req, self.kv.hold(req))
        self.kv.release(req)
        self.running.remove(req)
        self._left_queues(req)

    # ---- policy helpers -----------------------------------------------------------------------
    def _plan(self, batch: ScheduledBatch, req: Request, n: int, drafts=()) -> None:
        """Add a request's work to the step, and charge its tenant for it: prompt tokens as
        input, the rest (the token to sample from, drafts to verify) as output."""
        batch.items.append(ScheduledItem.plan(req, n, drafts))
        prompt = max(0, min(n, req.num_prompt_tokens - req.num_computed_tokens))
        self.fair.charge(req.share.tenant, prompt, n - prompt)

    def _rank(self, req: Request) -> tuple:
        """Smaller runs first: priority, then (fair) the tenant's counter, then arrival; so
        max() is the preemption victim: the lowest class, the most served tenant, the newest."""
        if self.config.schedule_policy == "fair":
            return (req.priority, self.fair.counter(req.share.tenant), req.arrival_seq)
        return (req.priority, req.arrival_seq)

    def _tenant_at_cap(self, req: Request) -> bool:
        cap = req.share.max_running
        if cap is None:
            return False
        return sum(r.share.tenant == req.share.tenant for r in self.running) >= cap

    def _admission_order(self):
        if self.config.schedule_policy == "fair":
            return self._fair_order()
        if (
            self.config.schedule_policy == "lpm"
            and self.kv.radix is not None
            and len(self.waiting) <= LPM_MAX_QUEUE
        ):
            match = {id(r): self.kv.prefix_match_length(r) for r in self.waiting}
            aged = time.monotonic() - LPM_MAX_WAIT_S

            def order(r: Request) -> tuple:
                waited_long = r.arrival_time <= aged
                return (
                    r.priority,
                    not waited_long,
                    0 if waited_long else -match[id(r)],
                    r.arrival_seq,
                )

            return sorted(self.waiting, key=order)
        return sorted(self.waiting, key=self._rank)

    def _fair_order(self):
        """The waiting requests, each time the best by (priority, its tenant's counter as it
        stands now, arrival): admitting one charges its tenant, which may change the next."""
        left = list(self.waiting)
        while left:
            best = min(left, key=self._rank)
            left.remove(best)
            yield best

    def _preempt(self, req: Request, batch: ScheduledBatch, budget: _Budget) -> None:
        batch.drop(req)
        budget.give_back(req)
        self.kv.release(req)
        req.draft_ids = []  # proposed for the state it loses
        req.num_preemptions += 1
        req.status = RequestStatus.WAITING
        self.running.remove(req)
        self.waiting.append(req)
        self.counters["preemptions"] += 1
        log.debug("preempted %s (%d tokens)", req.request_id, req.num_tokens)

    def _abort(self, req: Request, error: str | None) -> RequestOutput:
        if req in self.running:
            self.running.remove(req)
            self._left_queues(req)
        elif req in self.waiting:
            self.waiting.remove(req)
            self._left_queues(req)
        elif self.receiving.pop(req.request_id, None) is not None:
            self._left_queues(req)
            if not self.handoff.cancel(req):
                self.kv.quarantine(req)  # a read may still land in its slots
        if req.prefill_only and self.handoff is not None:
            self.handoff.withdraw(req, error or "aborted")
        self.kv.release(req)
        self.counters["aborted"] += 1
        return self.output_processor.on_abort(req, error)

    def expire_deadlines(self) -> list[RequestOutput]:
        now = time.monotonic()
        expired = [
            r
            for r in self.running + self.waiting + list(self.receiving.values())
            if r.deadline is not None and r.deadline < now
        ]
        outputs = [self._abort(r, REQUEST_TIMEOUT) for r in expired]
        queued_too_long = [
            r for r in self.waiting if r.queue_clock is not None and r.queue_clock.expired(now)
        ]
        return outputs + [self._abort(r, QUEUE_TIMEOUT) for r in queued_too_long]

    def reject_failed_grammars(self) -> list[RequestOutput]:
        """Abort waiting requests whose constraint failed to compile (the HTTP front end
        compiles first and answers 400, so this is for in-process callers)."""
        failed = []
        for req in list(self.waiting):
            if req.grammar is None:
                continue
            try:
                req.grammar.ready()
            except Exception as exc:  # noqa: BLE001 - the compile error, reported to the caller
                failed.append(self._abort(req, str(exc)))
        return failed

    def abort_all(self, error: str) -> list[RequestOutput]:
        """Fail every request (engine shutdown or a failed step)."""
        everyone = list(self.running) + list(self.waiting) + list(self.receiving.values())
        return [self._abort(r, error) for r in everyone]


def _headroom(req: Request) -> int:
    return max(0, min(req.params.max_new_tokens - len(req.output_ids), DECODE_HEADROOM_TOKENS))


def _grammar_ready(req: Request) -> bool:
    """Compiled (a failure is left for `reject_failed_grammars`)."""
    try:
        return req.grammar.ready()
    except Exception:  # noqa: BLE001
        return False


class _PrefillsInFlight:
    """The prompts being computed this step, to tell a waiting request that another one is
    computing a long stretch of its prompt right now (n > 1 samples, or many requests on one
    system prompt): it waits and reuses that stretch from the radix tree.

    Indexed by the stretch a waiting request would share (its SHARED_PREFIX_DEFER_TOKENS
    tokens after its cached prefix), per cached length: a burst on one system prompt differs
    only there, and comparing whole prompts against every request admitted before made a
    step's scheduling quadratic (256 prompts of 1,024 shared + 32 own tokens: 226 ms in one
    step, 11 ms indexed)."""

    def __init__(self, requests):
        self._requests = list(requests)
        self._by_start: dict[int, dict[tuple, list[Request]]] = {}

    def add(self, req: Request) -> None:
        self._requests.append(req)
        for start, index in self._by_start.items():
            _index_stretch(index, start, req)

    def shares(self, req: Request) -> bool:
        """True when a prompt in flight has this request's prompt up to its cached prefix
        plus SHARED_PREFIX_DEFER_TOKENS tokens."""
        start = req.cached_len
        if len(req.prompt_ids) < start + SHARED_PREFIX_DEFER_TOKENS:
            return False
        index = self._by_start.get(start)
        if index is None:
            index = self._by_start[start] = {}
            for other in self._requests:
                _index_stretch(index, start, other)
        stretch = tuple(req.prompt_ids[start : start + SHARED_PREFIX_DEFER_TOKENS])
        candidates = index.get(stretch)
        if not candidates:  # the common case in a burst: no whole-prefix slice at all
            return False
        head = req.prompt_ids[:start]
        return any(other.prompt_ids[:start] == head for other in candidates)


def _index_stretch(index: dict, start: int, req: Request) -> None:
    end = start + SHARED_PREFIX_DEFER_TOKENS
    if len(req.prompt_ids) >= end:
        index.setdefault(tuple(req.prompt_ids[start:end]), []).append(req)


class _Budget:
    """The step's prompt-token budget, and what each request's chunk took from it (a
    preempted request gives its share back, as vLLM's scheduler does)."""

    def __init__(self, tokens: int):
        self.left = tokens
        self._charged: dict[Request, int] = {}

    def charge(self, req: Request, n: int) -> None:
        self.left -= n
        self._charged[req] = n

    def give_back(self, req: Request) -> None:
        self.left += self._charged.pop(req, 0)
