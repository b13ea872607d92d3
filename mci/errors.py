"""User-facing errors, and the one shape every HTTP part answers them in.

A `UserError` is a mistake in what the user gave us (a path, a config, a checkpoint, a flag).
The CLI prints its message on one line and exits with code 2; it never shows a traceback.
Bugs in mci stay ordinary exceptions so they are loud. Over HTTP (the server, the router, the
Ray Serve ingress) every error is OpenAI's error body (`error_body`).
"""

from __future__ import annotations


class UserError(Exception):
    """A problem with the user's input, reported as a one-line message."""


class CheckpointError(UserError):
    """The checkpoint on disk is missing, corrupted or does not match its config."""


class ConfigError(UserError):
    """The model config is missing, malformed or describes an unsupported model."""


class InvalidParameter(UserError):
    """A bad value for one named parameter; `param` names it (OpenAI's error.param) and `code`
    is OpenAI's error.code when there is one.

    Made with `named(param, template)`, the message is `template` with `{param}` standing for
    the parameter's name, so a front end reports it under its own name for the field
    (`renamed`): the engine's `max_new_tokens` is the OpenAI API's `max_tokens`.
    """

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code
        self._template: str | None = None

    @classmethod
    def named(cls, param: str, template: str, code: str | None = None) -> InvalidParameter:
        exc = cls(template.replace("{param}", param), param, code)
        exc._template = template
        return exc

    def renamed(self, names: dict[str, str]) -> InvalidParameter:
        """The same error under `names[param]` (itself when the name is not in `names`)."""
        if self.param not in names:
            return self
        if self._template is None:
            return InvalidParameter(str(self), names[self.param], self.code)
        return InvalidParameter.named(names[self.param], self._template, self.code)


class EngineBroken(RuntimeError):
    """The engine cannot take another step (a parallel run lost a rank or a collective timed
    out): the loop fails what is in flight and stops, instead of retrying forever."""


def error_body(message: str, type_: str, param=None, code=None) -> dict:
    """OpenAI's error body: {"error": {message, type, param, code}}."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
