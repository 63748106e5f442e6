"""The README's settings tables, made from the settings classes: each field's description is its
row's meaning (and its flag's `--help`). `python -m kvfleet.settings_doc` prints the tables;
tests/test_settings.py checks that README.md holds them as printed."""

from __future__ import annotations

from pydantic.fields import FieldInfo

from kvfleet.shared.byte_size import binary_size_text, is_byte_size
from kvfleet.shared.settings import (BatchApiSettings, BatchSettings, CommonSettings, GatewaySettings,
                             KernelSettings, UpSettings, WorkerSettings)

# (heading, settings class, the class whose fields an earlier table shows already)
SECTIONS = (
    ("Every process", CommonSettings, None),
    ("Gateway (`kvfleet gateway`; the batch API's limits are the batch worker's too)",
     GatewaySettings, CommonSettings),
    ("`kvfleet up` (besides the gateway's and the worker's settings)", UpSettings, GatewaySettings),
    ("Worker (`kvfleet worker`; `kvfleet up` passes them to its workers)", WorkerSettings,
     CommonSettings),
    ("Batch worker (`kvfleet batch-worker`; and the batch API's settings above)", BatchSettings,
     BatchApiSettings),
    ("CPU kernels (environment only: no flags)", KernelSettings, None),
)


ENV_ONLY = (KernelSettings,)  # read where a kernel is built or chosen, never a process's flag


def default_text(field: FieldInfo) -> str:
    """A field's default as the README and `--help` show it (markdown)."""
    extra = field.json_schema_extra or {}
    if "default_text" in extra:
        return extra["default_text"]
    value = field.default
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "on" if value else "off"
    if is_byte_size(field):
        return f"`{binary_size_text(value)}`"
    return f"`{value:g}`" if isinstance(value, float) else f"`{value}`"


def flag_text(name: str, field: FieldInfo) -> str:
    flag = "--" + name.replace("_", "-")
    return f"`{flag}` / `--no-{flag[2:]}`" if field.annotation is bool else f"`{flag}`"


def settings_table(settings_cls, shown=None) -> list[str]:
    with_flags = settings_cls not in ENV_ONLY
    lines = ["| variable | flag | default | meaning |", "|---|---|---|---|"]
    for name, field in settings_cls.model_fields.items():
        if shown is not None and name in shown.model_fields:
            continue
        flag = flag_text(name, field) if with_flags else "none"
        meaning = (field.description or "").replace("|", "\\|")
        lines.append(f"| `KVFLEET_{name.upper()}` | {flag} | {default_text(field)} | {meaning} |")
    return lines


def settings_tables() -> str:
    parts = []
    for heading, settings_cls, shown in SECTIONS:
        parts += [f"**{heading}**", "", *settings_table(settings_cls, shown), ""]
    return "\n".join(parts).rstrip("\n") + "\n"


if __name__ == "__main__":
    print(settings_tables(), end="")
