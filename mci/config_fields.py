"""Config sections whose fields carry their own CLI help, so the flags are never written twice.

Every component's settings are a frozen dataclass next to the component (`cache/config.py`,
`server/config.py`, ...) whose fields are declared with `option`; each section checks its own
values in `__post_init__` (a UserError naming the flag). `add_flags` turns sections into
argparse flags (`--field-name`, plus peers' spellings as aliases) and `from_args` builds a
section back from the parsed flags; `mci/cli.py` says which command takes which sections.
A field declared with `choices` is checked by `check_choices`, so a section built in code
(not through argparse) cannot hold a value its flag would refuse.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import TypeVar

from mci.errors import UserError

T = TypeVar("T")


def option(default, help: str, choices=None, aliases: tuple[str, ...] = (), secret: bool = False):
    """A config field with its CLI help; `aliases` are other flags for it (peers' spellings).
    A `secret` (an API key) is left out of the section's repr, so no log line can show it."""
    return dataclasses.field(
        default=default,
        repr=not secret,
        metadata={"help": help, "choices": choices, "aliases": aliases},
    )


def check_choices(section) -> None:
    """UserError naming the flag when a field declared with `choices` holds another value
    (None, an optional field left unset, always passes). Sections call it in __post_init__."""
    for f in dataclasses.fields(section):
        choices, value = f.metadata.get("choices"), getattr(section, f.name)
        if choices and value is not None and value not in choices:
            flag = "--" + f.name.replace("_", "-")
            raise UserError(f"{flag} must be one of {', '.join(choices)}, got {value!r}")


def _arg_type(tp):
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        tp = next(a for a in typing.get_args(tp) if a is not type(None))
    return tp


def add_flags(parser: argparse.ArgumentParser, *sections: type) -> None:
    """One flag per field of each section (a bool field is a store_true flag)."""
    for cls in sections:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            flags = ["--" + f.name.replace("_", "-"), *f.metadata.get("aliases", ())]
            tp = _arg_type(hints[f.name])
            help_text, choices = f.metadata["help"], f.metadata.get("choices")
            if tp is bool:
                parser.add_argument(*flags, dest=f.name, action="store_true", help=help_text)
            else:
                parser.add_argument(
                    *flags,
                    dest=f.name,
                    type=tp,
                    default=f.default,
                    choices=choices,
                    help=f"{help_text} (default: {f.default})",
                )


def from_args(section: type[T], args: argparse.Namespace) -> T:
    """The section built from flags `add_flags` added (it checks itself)."""
    return section(**{f.name: getattr(args, f.name) for f in dataclasses.fields(section)})
