"""The messages between the front end and the engine process, one dataclass each.

They cross one duplex `multiprocessing` pipe between our own two processes (pickled; never
from the network).

    front end -> engine:  AddRequest | AbortRequest | StateQuery | Shutdown
    engine -> front end:  Ready | Failed (once, at start-up)
                          Outputs (after every loop iteration with outputs)
                          Heartbeat (when nothing else was sent for HEARTBEAT_S: the loop
                          is alive; the front end's watchdog listens for silence)
                          StateReply (answers a StateQuery) | Rejected (an AddRequest refused)
"""

from __future__ import annotations

from dataclasses import dataclass

from mci.core.outputs import RequestOutput
from mci.core.request import Resume
from mci.core.sampling_params import SamplingParams


# ---- front end -> engine ----------------------------------------------------------------------
@dataclass(frozen=True)
class AddRequest:
    """A validated prompt; the engine fans it out into `params.n` samples (`sample_ids`)."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    priority: int = 0
    timeout_s: float | None = None
    resume: Resume | None = None
    # time.monotonic() (one clock for both processes) after which, if it has not been
    # scheduled, it ends with QUEUE_TIMEOUT; it survives a resend to a restarted engine
    queue_deadline: float | None = None


@dataclass(frozen=True)
class AbortRequest:
    sample_id: str


@dataclass(frozen=True)
class StateQuery:
    """Ask for stats and a live integrity check; answered by a StateReply with `token`."""

    token: int


@dataclass(frozen=True)
class Shutdown:
    """Abort what is in flight, send the aborted outputs, exit."""


# ---- engine -> front end ----------------------------------------------------------------------
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
    outputs: list[RequestOutput]
    stats: dict


@dataclass(frozen=True)
class Heartbeat:
    stats: dict


@dataclass(frozen=True)
class StateReply:
    token: int
    state: dict


@dataclass(frozen=True)
class Rejected:
    """The engine refused an AddRequest; each of its samples ends with this error."""

    sample_ids: list[str]
    message: str
