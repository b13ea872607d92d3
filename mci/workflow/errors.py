"""Typed errors that cross step boundaries: every failure of a workflow names the step it
happened in and what kind of failure it was, in process, over Ray, and over HTTP (as an OpenAI
error body plus `step`), never as a bare 500.

Retry rule: `retryable` describes the failure as it left the step that failed (its code raised,
its replica died). The handle that called that step is the only one that may retry it; once an
error has left a handle it is final, so an outer step never re-runs because an inner one failed.
"""

from __future__ import annotations

from mci.errors import error_body

# kind -> (HTTP status, retryable by default)
KINDS = {
    "invalid_input": (422, False),  # the input does not match the step's type
    "invalid_output": (500, False),  # the step returned something that is not its type
    "step_error": (502, True),  # the step's code raised
    "model_error": (502, True),  # a model call failed (transport, 5xx, the engine's error)
    "replica_died": (503, True),  # the process running the step went away mid-call
    "deadline_exceeded": (504, False),  # the end-to-end deadline passed
    "cancelled": (499, False),  # the client went away
}


class WorkflowError(Exception):
    """A failure inside a workflow, with the step it happened in."""

    def __init__(self, kind: str, step: str, message: str, retryable: bool | None = None):
        if kind not in KINDS:
            raise ValueError(f"unknown workflow error kind {kind!r}")
        super().__init__(f"step {step}: {message}")
        self.kind, self.step, self.message = kind, step, message
        self.retryable = KINDS[kind][1] if retryable is None else retryable

    @property
    def status(self) -> int:
        return KINDS[self.kind][0]

    def final(self) -> WorkflowError:
        """The same error, no longer retryable (it has left the handle that could retry)."""
        self.retryable = False
        return self

    def to_body(self) -> dict:
        """The OpenAI error body, with the failing step: {"error": {..., "step": NAME}}."""
        body = error_body(self.message, self.kind, code=self.kind)
        body["error"]["step"] = self.step
        return body

    @classmethod
    def from_body(cls, body: dict, retryable: bool | None = None) -> WorkflowError:
        error = body["error"]
        return cls(error["code"], error["step"], error["message"], retryable)

    @classmethod
    def wrap(cls, exc: BaseException, step: str) -> WorkflowError:
        """`exc`, raised by step `step`'s code, as a typed error (a WorkflowError passes)."""
        if isinstance(exc, WorkflowError):
            return exc
        return cls("step_error", step, f"{type(exc).__name__}: {exc}")
