"""`--served-model-name` as vLLM spells it: the flag's words or the variable's text, spaces or
commas, read alike by `kvfleet up`, `gateway` and `worker` and passed by `up` to its children
(the first name is the model's; the others are aliases), and the names the gateway resolves."""

from __future__ import annotations

import os

import pytest

from kvfleet.gateway.models.adapters import startup_adapters
from kvfleet.gateway.models.catalog import ModelCatalog, Target
from kvfleet.cli import build_parser
from kvfleet.flags import given_flags, settings_from_args
from kvfleet.up import LocalFleet
from kvfleet.shared.models import DEFAULT_MODEL
from kvfleet.shared.settings import GatewaySettings, UpSettings, WorkerSettings

HUB = "HuggingFaceTB/SmolLM2-135M-Instruct"


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in [n for n in os.environ if n.startswith("KVFLEET_")]:
        monkeypatch.delenv(name)


def test_without_the_flag_the_model_is_served_by_its_directory_name(tmp_path):
    model_dir = tmp_path / "my-model"
    model_dir.mkdir()
    assert GatewaySettings(model=str(model_dir)).served_names() == ["my-model"]
    assert WorkerSettings().served_names() == [DEFAULT_MODEL]
    assert WorkerSettings(model=HUB).served_names() == [HUB]  # an id: the id itself


@pytest.mark.parametrize("command", ["up", "gateway", "worker"])
@pytest.mark.parametrize("words", [[HUB, "smol", "tiny"], [f"{HUB},smol,tiny"],
                                   [f"{HUB}, smol", "tiny"], [HUB, "smol", "tiny", "smol"]])
def test_the_flag_takes_several_names_after_it_or_comma_separated(command, words):
    args = build_parser().parse_args([command, "--served-model-name", *words])
    settings_cls = {"up": UpSettings, "gateway": GatewaySettings, "worker": WorkerSettings}[command]
    settings = settings_from_args(settings_cls, args)
    assert settings.served_model_name == [HUB, "smol", "tiny"]  # in order, each once
    assert settings.served_names()[0] == HUB


@pytest.mark.parametrize("text", [f"{HUB} smol", f"{HUB},smol", f" {HUB} , smol ",
                                  f'["{HUB}", "smol"]'])
def test_the_variable_takes_the_same_spellings_or_a_json_list(monkeypatch, text):
    monkeypatch.setenv("KVFLEET_SERVED_MODEL_NAME", text)
    for settings_cls in (UpSettings, GatewaySettings, WorkerSettings):
        assert settings_cls().served_names() == [HUB, "smol"]


def test_an_empty_variable_is_the_default_and_a_bad_json_value_is_refused(monkeypatch):
    monkeypatch.setenv("KVFLEET_SERVED_MODEL_NAME", "")
    assert WorkerSettings().served_names() == [DEFAULT_MODEL]
    monkeypatch.setenv("KVFLEET_SERVED_MODEL_NAME", '[1, 2]')
    with pytest.raises(ValueError, match="served_model_name"):
        WorkerSettings()


def test_up_passes_the_names_to_its_children_and_only_to_the_models_workers(monkeypatch):
    args = build_parser().parse_args(["up", "--served-model-name", HUB, "smol",
                                      "--worker-models", f"{DEFAULT_MODEL},other"])
    env = given_flags(UpSettings, args) | given_flags(WorkerSettings, args)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert GatewaySettings().served_names() == [HUB, "smol"]  # what the gateway reads back
    assert WorkerSettings().served_names() == [HUB, "smol"]
    fleet = LocalFleet(1, env, [DEFAULT_MODEL, "other"], named_model=DEFAULT_MODEL)
    spawned = []
    monkeypatch.setattr(fleet, "_spawn", lambda role, extra: spawned.append(extra))
    for index in range(fleet.num_workers):
        fleet.start_worker(index)
    assert "KVFLEET_SERVED_MODEL_NAME" not in spawned[0]  # --model's worker: the fleet's names
    assert spawned[1]["KVFLEET_SERVED_MODEL_NAME"] == ""  # another model's: its own id
    monkeypatch.setenv("KVFLEET_MODEL", "other")
    monkeypatch.setenv("KVFLEET_SERVED_MODEL_NAME", spawned[1]["KVFLEET_SERVED_MODEL_NAME"])
    assert WorkerSettings().served_names() == ["other"]


def test_an_alias_resolves_to_the_first_name_and_unknown_names_stay_unknown():
    catalog = ModelCatalog(HUB, DEFAULT_MODEL, None, aliases=["smol", HUB])
    assert catalog.lookup("smol") == catalog.lookup(HUB) == Target(HUB, HUB)
    assert catalog.is_served_model("smol")
    assert catalog.lookup(DEFAULT_MODEL) is None  # the directory's name is not one of its names
    assert catalog.lookup("nope") is None


def test_start_up_adapters_of_an_alias_are_the_first_names():
    entries = ["sql=/adapters/sql", '{"name": "chat", "path": "/adapters/chat", '
                                    '"base_model_name": "smol"}']
    adapters = startup_adapters(entries, HUB, [HUB, "smol"])
    assert [(a.name, a.base_model) for a in adapters] == [("sql", HUB), ("chat", HUB)]
    with pytest.raises(ValueError, match="served model's own name"):
        startup_adapters(["smol=/adapters/x"], HUB, [HUB, "smol"])
    with pytest.raises(ValueError, match="is not --model"):
        startup_adapters(['{"name": "x", "path": "/a", "base_model_name": "other"}'], HUB,
                         [HUB, "smol"])
