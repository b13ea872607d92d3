"""The engine's command vocabulary: every message that crosses a process or rank boundary.

    to an engine:    AddRequest | AbortRequest | AbortAll | StateQuery | Shutdown
    from an engine:  Ready | Failed (the engine process, once, at start-up)
                     Outputs (outputs since the last message, with fresh stats)
                     Heartbeat (nothing else was sent for a while: the loop is alive)
                     StateReply (answers a StateQuery)
    between ranks:   Round (rank 0 -> every rank: each rank's commands, what the round does)
                     RoundReport (every rank -> rank 0)

The same classes travel every path: the in-process `Engine` queues them for its loop, the
front end sends them down the pipe to the engine process (server/engine_supervisor.py ->
server/engine_process.py), and under data-parallel attention rank 0 forwards them to the rank
that runs the request (engine/dp_attention.py), where they take the same `RequestFront` path
as on rank 0. They are pickled between our own processes only, never from the network.

Times are durations (seconds from when the receiver takes the command), never clock
readings: ranks may run on other machines, whose monotonic clocks differ. A sender that holds
a command for a while passes it on `aged` by that long.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from mci.core.outputs import RequestOutput
from mci.core.request import KVHandoff, Resume, TenantShare
from mci.core.sampling_params import SamplingParams


# ---- to an engine -----------------------------------------------------------------------------
@dataclass(frozen=True)
class AddRequest:
    """A checked prompt. The engine fans it out into `params.n` samples (ids from
    `core.request_ids.sample_ids`); each sample's outputs carry its sample id."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    priority: int = 0  # smaller runs first
    timeout_s: float | None = None  # then aborted with REQUEST_TIMEOUT
    resume: Resume | None = None  # n = 1: the output to continue from
    # then ended with QUEUE_TIMEOUT unless one of its samples has been scheduled
    queue_timeout_s: float | None = None
    share: TenantShare = TenantShare()  # whose it is (the front end resolved the tenant)
    # prefill-decode disaggregation: the room and side of this prompt's KV (each sample takes
    # `handoff.for_sample`); None: computed and decoded here
    handoff: KVHandoff | None = None

    def aged(self, elapsed_s: float) -> AddRequest:
        """This command passed on `elapsed_s` after it was taken: its bounds that much closer."""
        if elapsed_s <= 0 or (self.timeout_s is None and self.queue_timeout_s is None):
            return self
        return dataclasses.replace(
            self,
            timeout_s=_less(self.timeout_s, elapsed_s),
            queue_timeout_s=_less(self.queue_timeout_s, elapsed_s),
        )


def _less(bound: float | None, elapsed_s: float) -> float | None:
    return None if bound is None else max(0.0, bound - elapsed_s)


@dataclass(frozen=True)
class AbortRequest:
    """End a sample: its final output reports finish_reason 'abort'."""

    request_id: str  # the sample's id, as its outputs carry it


@dataclass(frozen=True)
class AbortAll:
    """End every request in flight with `error` (a data-parallel run failing or closing)."""

    error: str


@dataclass(frozen=True)
class StateQuery:
    """Ask for stats and a live integrity check; answered by a StateReply with `token`."""

    token: int


@dataclass(frozen=True)
class Shutdown:
    """Abort what is in flight, send the aborted outputs, exit."""


Command = AddRequest | AbortRequest | AbortAll | StateQuery | Shutdown


# ---- from an engine ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Ready:
    """The engine is loaded: its pid, weight bytes and first stats."""

    info: dict


@dataclass(frozen=True)
class Failed:
    """The engine could not start (bad checkpoint, bad flags): a one-line reason."""

    message: str


@dataclass(frozen=True)
class Outputs:
    """Outputs since the last message (a refused AddRequest's samples end here too, each with
    its error), and the engine's stats after them."""

    outputs: list[RequestOutput]
    stats: dict


@dataclass(frozen=True)
class Heartbeat:
    stats: dict


@dataclass(frozen=True)
class StateReply:
    token: int
    state: dict


# ---- between ranks (data-parallel attention) --------------------------------------------------
@dataclass
class Round:
    """What rank 0 broadcasts: each rank's commands (AddRequest | AbortRequest | AbortAll) and
    what the round does after them."""

    commands: list[list[AddRequest | AbortRequest | AbortAll]]
    step: bool = False
    state: bool = False  # report state() (integrity checked) instead of stats()
    close: bool = False


@dataclass
class RoundReport:
    """What each rank sends back."""

    outputs: list[RequestOutput] = field(default_factory=list)
    has_work: bool = False
    stats: dict = field(default_factory=dict)
