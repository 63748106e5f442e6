"""Settings classes as command-line flags: one flag per field (`kv_memory` -> `--kv-memory`), left
unset unless given, so a missing flag defers to its `KVFLEET_*` variable and then to the default."""

from __future__ import annotations

import argparse
import types
import typing
from pathlib import Path

from pydantic import ValidationError


def _flag_type(annotation):
    """The argparse type of a settings field (Optional[X] -> X)."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        annotation = args[0]
    return annotation if annotation in (int, float, str, bool, Path) else str


def add_settings_flags(parser: argparse.ArgumentParser, settings_cls, skip=()) -> None:
    """One flag per settings field; defaults None so unset flags defer to env and defaults."""
    group = parser.add_argument_group(f"{settings_cls.__name__} (env KVFLEET_<NAME>)")
    for name, field in settings_cls.model_fields.items():
        if name in skip:
            continue
        flag = "--" + name.replace("_", "-")
        kind = _flag_type(field.annotation)
        help_text = f"default: {field.default!s}" if field.default not in (None, "") else None
        if kind is bool:
            group.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction,
                               default=None, help=help_text)
        elif typing.get_origin(field.annotation) is typing.Literal:
            group.add_argument(flag, dest=name, choices=typing.get_args(field.annotation),
                               default=None, help=help_text)
        else:
            group.add_argument(flag, dest=name, type=kind, default=None, help=help_text)


def settings_from_args(settings_cls, args: argparse.Namespace):
    given = {name: getattr(args, name) for name in settings_cls.model_fields
             if getattr(args, name, None) is not None}
    try:
        return settings_cls(**given)
    except ValidationError as exc:
        problems = "; ".join(f"--{'-'.join(map(str, e['loc'])).replace('_', '-')}: {e['msg']}"
                             for e in exc.errors())
        raise SystemExit(f"kvfleet: invalid setting: {problems}") from None


def given_flags(settings_cls, args: argparse.Namespace) -> dict[str, str]:
    """Flags the user gave, as KVFLEET_* environment entries for child processes."""
    env = {}
    for name in settings_cls.model_fields:
        value = getattr(args, name, None)
        if value is not None:
            env[f"KVFLEET_{name.upper()}"] = str(value).lower() if isinstance(value, bool) \
                else str(value)
    return env
