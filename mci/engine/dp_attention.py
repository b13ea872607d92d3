"""Data-parallel attention: one scheduler and KV cache per rank, stepped in lockstep.

Each rank holds whole attention and dense layers and a share of the routed experts, and runs
its own requests over its own latent KV cache (so the run's KV capacity is the sum of the
ranks'). The MoE layers exchange tokens between ranks (mci/parallel/dispatch.py), so every rank
must run each step's forward together: a rank without work runs an idle forward that only
takes part in the exchanges.

Rank 0 is the engine the front end talks to. `DataParallelCore` stands in for its EngineCore:
it places each new prompt on the least-loaded rank and drives rounds. A round is

    rank 0 broadcasts a Round: every rank's commands (AddRequest / AbortRequest / AbortAll,
           the vocabulary of engine/commands.py) and what to do
    each rank applies its commands exactly as rank 0 applies its own (an AddRequest becomes
           its requests through the rank's RequestFront, deadlines and queue bound included),
           then (a step round) runs one step or an idle forward
    rank 0 gathers every rank's RoundReport: outputs, whether it has work, stats (or state)

Followers run `follow_rounds` until rank 0 closes the run. Invariant: in a step round every
rank runs exactly one main-model forward, real or idle (speculative decoding, whose drafts
would add forwards on some ranks only, is refused with data-parallel attention).
"""

from __future__ import annotations

import time

import torch.distributed as dist

from mci.core.outputs import RequestOutput
from mci.core.request_ids import sample_ids
from mci.engine.commands import AbortAll, AbortRequest, AddRequest, Round, RoundReport
from mci.engine.core import EngineCore, check_idle
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
RankCommand = AddRequest | AbortRequest | AbortAll


def _apply(core: EngineCore, commands: list[RankCommand]) -> list[RequestOutput]:
    """A rank's commands, applied as rank 0 applies its own (AddRequest through the core's
    RequestFront)."""
    outputs = []
    for command in commands:
        if isinstance(command, AddRequest):
            outputs += core.add(command)
        elif isinstance(command, AbortRequest):
            outputs += core.abort(command.request_id)
        elif isinstance(command, AbortAll):
            outputs += core.abort_all(command.error)
        else:
            raise TypeError(f"unknown rank command {command!r}")
    return outputs


def _run_round(core: EngineCore, model, round_: Round, commands: list[RankCommand]) -> RoundReport:
    """One rank's part of a round (rank 0's too)."""
    outputs = _apply(core, commands)
    if round_.step:
        before = core.runner.forwards
        if core.has_work:
            outputs += core.step()
        if core.runner.forwards == before:  # nothing was scheduled here: pair the forward
            model.idle_forward()
    stats = core.state() if round_.state else core.stats()
    return RoundReport(outputs, core.has_work, stats)


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
    """Rank 0's engine core under data-parallel attention (a `StepCore`, as EngineLoop drives
    it); `local` is rank 0's own EngineCore. A prompt's samples all run on one rank, the
    least loaded (they share its prompt's prefix cache)."""

    def __init__(self, local: EngineCore, model, parallel: ParallelContext, timeout_s: float):
        self.local = local
        self.model = model
        self.parallel = parallel
        self._keepalive_s = timeout_s / 3
        world = parallel.world_size
        # each rank's commands for the next round, with when they were taken (time.monotonic())
        self._pending: list[list[tuple[RankCommand, float]]] = [[] for _ in range(world)]
        self._owner: dict[str, int] = {}  # sample id -> rank
        self._load = [0] * world  # samples in flight per rank
        self._has_work = [False] * world  # the other ranks', as of the last round
        self._stats: list[dict] = [{} for _ in range(world)]
        # final outputs of rounds that were not steps (state, keepalive): the loop receives
        # them with the next step
        self._held: list[RequestOutput] = []
        self._last_round = time.monotonic()
        self._closed = False
        self.broken = False

    # rank 0's parts, which the Engine shows as its own
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
        return (
            any(self._has_work[1:]) or any(self._pending) or bool(self._held) or self.local.has_work
        )

    def rank_of(self, sample_id: str) -> int | None:
        """The rank that runs a sample in flight (None once it has ended)."""
        return self._owner.get(sample_id)

    def add(self, command: AddRequest) -> list[RequestOutput]:
        rank = min(range(self.parallel.world_size), key=lambda r: (self._load[r], r))
        ids = sample_ids(command.request_id, command.params.n)
        for sid in ids:
            self._owner[sid] = rank
        self._load[rank] += len(ids)
        if rank == 0:
            return self._finished(self.local.add(command))
        self._pending[rank].append((command, time.monotonic()))
        return []  # a refused one's outputs come with the next round

    def abort(self, request_id: str) -> list[RequestOutput]:
        rank = self._owner.get(request_id)
        if rank is None:
            return []
        if rank == 0:
            return self._finished(self.local.abort(request_id))
        self._pending[rank].append((AbortRequest(request_id), time.monotonic()))
        return []  # its output comes with the next round

    def abort_all(self, error: str) -> list[RequestOutput]:
        for rank in range(1, self.parallel.world_size):
            self._pending[rank].append((AbortAll(error), time.monotonic()))
        outputs = self._take_held() + self._finished(self.local.abort_all(error))
        if not self._closed:
            outputs += self._round(step=False)
        else:  # no round can reach the other ranks: their samples end here
            lost = [sid for sid, rank in self._owner.items() if rank != 0]
            outputs += self._finished([RequestOutput.aborted(sid, error) for sid in lost])
            self._pending = [[] for _ in self._pending]
        return outputs

    def step(self) -> list[RequestOutput]:
        return self._take_held() + self._round(step=True)

    def wake_on(self, fd: int | None) -> None:
        self.local.wake_on(fd)  # ranks step in lockstep: one decode step a step (builder.py)

    def idle(self) -> None:
        if time.monotonic() - self._last_round > self._keepalive_s:
            # the followers wait inside a collective that times out
            self._held += self._round(step=False)

    def stats(self) -> dict:
        """Rank 0's stats with the other ranks' (as of the last round) added up."""
        return self._combined([self.local.stats(), *self._stats[1:]])

    def state(self) -> dict:
        """Every rank's state, checked now (one round), added up."""
        self._held += self._round(step=False, state=True)
        return self._combined(self._stats)

    def check_integrity(self) -> None:
        """AssertionError unless every rank's slot accounting holds (one round)."""
        if not self.state().get("integrity_ok", False):
            raise AssertionError("slot accounting is broken on a rank (see /internal/state)")

    def check_idle_integrity(self) -> None:
        """AssertionError unless, with nothing in flight on any rank, every slot is free or
        a tree's and no lock is held (one round)."""
        check_idle(self.state())

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
        now = time.monotonic()
        commands = [[_aged(c, now - taken) for c, taken in rank] for rank in self._pending]
        round_ = Round(commands, step=step, state=state)
        self._pending = [[] for _ in self._pending]
        try:
            self._broadcast(round_)
            mine = _run_round(self.local, self.model, round_, [])
            reports: list[RoundReport] = [None] * self.parallel.world_size
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
        return self._finished(outputs)

    def _take_held(self) -> list[RequestOutput]:
        held, self._held = self._held, []
        return held

    def _finished(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """`outputs`, after the samples they end are no longer counted on their rank."""
        for out in outputs:
            if out.finished and out.request_id in self._owner:
                self._load[self._owner.pop(out.request_id)] -= 1
        return outputs

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


def _aged(command: RankCommand, elapsed_s: float) -> RankCommand:
    """A command as it leaves rank 0: an AddRequest's time bounds count from when rank 0
    took it, not from the round."""
    return command.aged(elapsed_s) if isinstance(command, AddRequest) else command
