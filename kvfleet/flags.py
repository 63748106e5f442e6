"""Settings classes as command-line flags: one flag per field (`kv_memory` -> `--kv-memory`), left
unset unless given, so a missing flag defers to its `KVFLEET_*` variable and then to the default.
A flag's help is its field's description and default (the README's row, kvfleet/settings_doc.py)."""

from __future__ import annotations

import argparse
import json
import types
import typing
from pathlib import Path

from pydantic import ValidationError
from pydantic.fields import FieldInfo

from kvfleet.settings_doc import default_text
from kvfleet.shared.byte_size import is_byte_size


def _flag_type(field: FieldInfo):
    """The argparse type of a settings field (Optional[X] -> X; a byte size stays text)."""
    annotation = field.annotation
    if is_byte_size(field):
        return str
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
        kind = _flag_type(field)
        help_text = _help(field)
        if kind is bool:
            group.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction,
                               default=None, help=help_text)
        elif _is_list(field):  # several values after one flag (vLLM's --lora-modules a=x b=y)
            group.add_argument(flag, dest=name, nargs="+", default=None, help=help_text)
        elif typing.get_origin(field.annotation) is typing.Literal:
            group.add_argument(flag, dest=name, choices=typing.get_args(field.annotation),
                               default=None, help=help_text)
        else:
            group.add_argument(flag, dest=name, type=kind, default=None, help=help_text)


def _is_list(field: FieldInfo) -> bool:
    annotation = field.annotation
    if typing.get_origin(annotation) is typing.Annotated:
        annotation = typing.get_args(annotation)[0]
    return typing.get_origin(annotation) is list


def _help(field: FieldInfo) -> str:
    text = f"{field.description} (default: {default_text(field)})".replace("`", "")
    return text.replace("%", "%%")  # argparse formats help with %


def settings_from_args(settings_cls, args: argparse.Namespace):
    given = {name: getattr(args, name) for name in settings_cls.model_fields
             if getattr(args, name, None) is not None}
    try:
        return settings_cls(**given)
    except ValidationError as exc:
        problems = "; ".join(f"{_setting_names(e['loc'])}: {e['msg']}" for e in exc.errors())
        raise SystemExit(f"kvfleet: invalid setting: {problems}") from None


def _setting_names(loc: tuple) -> str:
    """'--kv-dtype (KVFLEET_KV_DTYPE)': where a value of the setting at `loc` comes from."""
    name = "_".join(map(str, loc))
    return f"--{name.replace('_', '-')} (KVFLEET_{name.upper()})"


def given_flags(settings_cls, args: argparse.Namespace) -> dict[str, str]:
    """Flags the user gave, as KVFLEET_* environment entries for child processes."""
    env = {}
    for name in settings_cls.model_fields:
        value = getattr(args, name, None)
        if isinstance(value, list):  # a JSON list: what the field's variable reads back exactly
            env[f"KVFLEET_{name.upper()}"] = json.dumps(value)
        elif value is not None:
            env[f"KVFLEET_{name.upper()}"] = str(value).lower() if isinstance(value, bool) \
                else str(value)
    return env
