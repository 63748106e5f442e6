"""The README's settings tables, made from the settings classes: each field's description is its
row's meaning (and its flag's `--help`). The worker's engine settings get a table per group of
EngineConfig (shared/engine_config.py), as the engine reads them. `python -m kvfleet.settings_doc`
prints the tables; tests/test_settings.py checks that README.md holds them as printed."""

from __future__ import annotations

from pydantic.fields import FieldInfo

from kvfleet.shared.byte_size import binary_size_text, is_byte_size
from kvfleet.shared.engine_config import ENGINE_ONLY, FIELD_GROUPS
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


def settings_table(settings_cls, shown=None, names=None) -> list[str]:
    """The rows of `names` (all fields but `shown`'s unless given) of a settings class."""
    with_flags = settings_cls not in ENV_ONLY
    lines = ["| variable | flag | default | meaning |", "|---|---|---|---|"]
    if names is None:
        names = [name for name in settings_cls.model_fields
                 if shown is None or name not in shown.model_fields]
    for name in names:
        field = settings_cls.model_fields[name]
        flag = flag_text(name, field) if with_flags else "none"
        meaning = (field.description or "").replace("|", "\\|")
        lines.append(f"| `KVFLEET_{name.upper()}` | {flag} | {default_text(field)} | {meaning} |")
    return lines


def engine_tables() -> list[str]:
    """The worker's engine settings, a table per group (`config.cache`, ...), in their order."""
    parts = []
    for group in dict.fromkeys(FIELD_GROUPS.values()):
        names = [name for name, of in FIELD_GROUPS.items()
                 if of == group and name not in ENGINE_ONLY]
        parts += [f"**Worker engine: `{group}`**", "", *settings_table(WorkerSettings, names=names),
                  ""]
    return parts


def settings_tables() -> str:
    parts = []
    for heading, settings_cls, shown in SECTIONS:
        names = None
        if settings_cls is WorkerSettings:  # its engine settings follow, by group
            names = [name for name in settings_cls.model_fields
                     if name not in shown.model_fields and name not in FIELD_GROUPS]
        parts += [f"**{heading}**", "", *settings_table(settings_cls, shown, names), ""]
        if settings_cls is WorkerSettings:
            parts += engine_tables()
    return "\n".join(parts).rstrip("\n") + "\n"


if __name__ == "__main__":
    print(settings_tables(), end="")
