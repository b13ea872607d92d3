"""User-facing errors.

A `UserError` is a mistake in what the user gave us (a path, a config, a checkpoint, a flag).
The CLI prints its message on one line and exits with code 2; it never shows a traceback.
Bugs in mci stay ordinary exceptions so they are loud.
"""


class UserError(Exception):
    """A problem with the user's input, reported as a one-line message."""


class CheckpointError(UserError):
    """The checkpoint on disk is missing, corrupted or does not match its config."""


class ConfigError(UserError):
    """The model config is missing, malformed or describes an unsupported model."""


class InvalidParameter(UserError):
    """A bad value for one named parameter; `param` names it (OpenAI's error.param)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param
