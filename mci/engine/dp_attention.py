"""Data-parallel attention: one scheduler and KV cache per rank, stepped in lockstep.

Each rank holds whole attention and dense layers and a share of the routed experts, and runs
its own requests over its own latent KV cache (so the run's KV capacity is the sum of the
ranks'). The MoE layers exchange tokens between ranks (mci/parallel/dispatch.py), so every rank
must run each step's forward together: a rank without work runs an idle forward that only
takes part in the exchanges.

Rank 0 is the engine the front end talks to. `DataParallelCore` stands in for its EngineCore:
it places each new request on the least-loaded rank and drives rounds. A round is

    rank 0 broadcasts every rank's commands (add / abort / abort all) and what to do
    each rank applies its commands, then (a step round) runs one step or an idle forward
    rank 0 gathers every rank's outputs, whether it has work, and its stats (or state)

Followers run `follow_rounds` until rank 0 closes the run. Invariant: in a step round every
rank runs exactly one main-model forward, real or idle (speculative decoding, whose drafts
would add forwards on some ranks only, is refused with data-parallel attention).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch.distributed as dist

from mci.core.outputs import RequestOutput
from mci.core.request import Request
from mci.engine.core import EngineCore
from mci.errors import EngineBroken
from mci.parallel.context import ParallelContext

STATS_SUMMED = (
    "num_running",
    "num_waiting",
    "num_slots",
    "free_slots",
    "tree_tokens",
    "tree_locked_tokens",
)


@dataclass
class Round:
    """What rank 0 broadcasts: each rank's commands and what the round does."""

    commands: list[list[tuple]]
    step: bool = False
    state: bool = False  # report state() (integrity checked) instead of stats()
    close: bool = False


@dataclass
class Report:
    """What each rank sends back."""

    outputs: list[RequestOutput] = field(default_factory=list)
    has_work: bool = False
    stats: dict = field(default_factory=dict)


def _apply(core: EngineCore, commands: list[tuple]) -> list[RequestOutput]:
    outputs = []
    for command in commands:
        kind = command[0]
        if kind == "add":
            _, rid, prompt_ids, params, priority, remaining, output_ids, text_offset = command
            deadline = None if remaining is None else time.monotonic() + remaining
            req = Request(rid, prompt_ids, params, priority, deadline)
            for token in output_ids:  # a resumed request's output so far
                req.append_token(token)
            req.resumed_text_offset = text_offset
            out = core.add_request(req)
        elif kind == "abort":
            out = core.abort_request(command[1])
        else:  # abort_all
            outputs += core.abort_all(command[1])
            continue
        if out is not None:
            outputs.append(out)
    return outputs


def _run_round(core: EngineCore, model, round_: Round, commands: list[tuple]) -> Report:
    """One rank's part of a round (rank 0's too)."""
    outputs = _apply(core, commands)
    if round_.step:
        before = core.runner.forwards
        if core.has_work:
            outputs += core.step()
        if core.runner.forwards == before:  # nothing was scheduled here: pair the forward
            model.idle_forward()
    stats = core.state() if round_.state else core.stats()
    return Report(outputs, core.has_work, stats)


def follow_rounds(core: EngineCore, model, parallel: ParallelContext) -> None:
    """A follower rank's life: take part in every round until rank 0 closes the run."""
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0, group=parallel.group)
        round_: Round = box[0]
        if round_.close:
            return
        report = _run_round(core, model, round_, round_.commands[parallel.rank])
        dist.gather_object(report, None, dst=0, group=parallel.group)


class DataParallelCore:
    """Rank 0's engine core under data-parallel attention (the interface EngineLoop drives);
    `local` is rank 0's own EngineCore."""

    def __init__(self, local: EngineCore, model, parallel: ParallelContext, timeout_s: float):
        self.local = local
        self.model = model
        self.parallel = parallel
        self._keepalive_s = timeout_s / 3
        world = parallel.world_size
        self._pending: list[list[tuple]] = [[] for _ in range(world)]
        self._owner: dict[str, int] = {}  # request id -> rank
        self._load = [0] * world  # requests in flight per rank
        self._has_work = [False] * world  # the other ranks', as of the last round
        self._stats: list[dict] = [{} for _ in range(world)]
        self._last_round = time.monotonic()
        self._closed = False
        self.broken = False

    # what the engine's assembly and callers read from a core
    @property
    def scheduler(self):
        return self.local.scheduler

    @property
    def kv(self):
        return self.local.kv

    @property
    def runner(self):
        return self.local.runner

    @property
    def grammar(self):
        return self.local.grammar

    @property
    def has_work(self) -> bool:
        return any(self._has_work[1:]) or any(self._pending) or self.local.has_work

    def add_request(self, req: Request) -> RequestOutput | None:
        rank = min(range(self.parallel.world_size), key=lambda r: (self._load[r], r))
        self._owner[req.request_id] = rank
        self._load[rank] += 1
        if rank == 0:
            out = self.local.add_request(req)
            if out is not None:
                self._finished(out)
            return out
        remaining = None if req.deadline is None else req.deadline - time.monotonic()
        add = (
            "add",
            req.request_id,
            req.prompt_ids,
            req.params,
            req.priority,
            remaining,
            list(req.output_ids),
            req.resumed_text_offset,
        )
        self._pending[rank].append(add)
        return None

    def abort_request(self, request_id: str) -> RequestOutput | None:
        rank = self._owner.get(request_id)
        if rank is None:
            return None
        if rank == 0:
            out = self.local.abort_request(request_id)
            if out is not None:
                self._finished(out)
            return out
        self._pending[rank].append(("abort", request_id))
        return None  # its output comes with the next round

    def abort_all(self, error: str) -> list[RequestOutput]:
        for rank in range(1, self.parallel.world_size):
            self._pending[rank].append(("abort_all", error))
        outputs = self.local.abort_all(error)
        if not self._closed:
            outputs += self._round(step=False)
        for out in outputs:
            self._finished(out)
        return outputs

    def step(self) -> list[RequestOutput]:
        return self._round(step=True)

    def idle(self) -> None:
        if time.monotonic() - self._last_round > self._keepalive_s:
            self._round(step=False)  # the followers wait inside a collective that times out

    def stats(self) -> dict:
        """Rank 0's stats with the other ranks' (as of the last round) added up."""
        return self._combined([self.local.stats(), *self._stats[1:]])

    def state(self) -> dict:
        """Every rank's state, checked now (one round), added up."""
        self._round(step=False, state=True)
        return self._combined(self._stats)

    def check_integrity(self) -> None:
        """AssertionError unless every rank's slot accounting holds (one round)."""
        if not self.state().get("integrity_ok", False):
            raise AssertionError("slot accounting is broken on a rank (see /internal/state)")

    def check_idle_integrity(self) -> None:
        """AssertionError unless, with nothing in flight on any rank, every slot is free or
        a tree's and no lock is held."""
        state = self.state()
        if state["num_running"] or state["num_waiting"]:
            raise AssertionError("requests still in flight")
        if state["free_slots"] + state["tree_tokens"] != state["num_slots"]:
            raise AssertionError(f"slots leaked: {state}")
        if state["tree_locked_tokens"]:
            raise AssertionError(f"a lock leaked: {state['tree_locked_tokens']} tokens")

    def close(self) -> None:
        """Release the other ranks; nothing to send when the run is broken."""
        try:
            if not self._closed:
                self._closed = True
                self._broadcast(Round([[] for _ in self._pending], close=True))
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()

    # ---- rounds -------------------------------------------------------------------------------
    def _broadcast(self, round_: Round) -> None:
        dist.broadcast_object_list([round_], src=0, group=self.parallel.group)

    def _round(self, step: bool, state: bool = False) -> list[RequestOutput]:
        if self._closed:
            raise EngineBroken("the data-parallel run is closed")
        round_ = Round(self._pending, step=step, state=state)
        self._pending = [[] for _ in self._pending]
        try:
            self._broadcast(round_)
            mine = _run_round(self.local, self.model, round_, [])
            reports: list[Report] = [None] * self.parallel.world_size
            dist.gather_object(mine, reports, dst=0, group=self.parallel.group)
        except Exception as exc:
            self._closed = self.broken = True
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)
            raise EngineBroken(f"data-parallel run failed: {reason}") from exc
        self._last_round = time.monotonic()
        outputs = []
        for rank, report in enumerate(reports):
            self._has_work[rank] = report.has_work
            self._stats[rank] = report.stats
            outputs += report.outputs
        for out in outputs:
            self._finished(out)
        return outputs

    def _finished(self, out: RequestOutput) -> None:
        if out.finished and out.request_id in self._owner:
            self._load[self._owner.pop(out.request_id)] -= 1

    @staticmethod
    def _combined(per_rank: list[dict]) -> dict:
        combined = dict(per_rank[0])
        for other in per_rank[1:]:
            for key in STATS_SUMMED:
                if key in other:
                    combined[key] = combined.get(key, 0) + other[key]
            counters = combined.setdefault("counters", {})
            for key, value in other.get("counters", {}).items():
                counters[key] = counters.get(key, 0) + value
            if "integrity_ok" in other:
                combined["integrity_ok"] = (
                    combined.get("integrity_ok", True) and other["integrity_ok"]
                )
        slots = combined.get("num_slots", 0)
        if slots:  # each rank's usage, weighted by its pool
            used = sum(r.get("kv_cache_usage", 0) * r.get("num_slots", 0) for r in per_rank)
            combined["kv_cache_usage"] = used / slots
        return combined
