"""Constrained requests in the engine: they follow their grammar at temperature 1, batch with
free requests without changing them, and a resumed request continues its stream exactly."""

from __future__ import annotations

import json

import pytest

from kvfleet.shared.wire import SamplingParams
from kvfleet.shared.structured import OutputConstraint
from tests.engine.tiny_models import run_to_completion

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 8},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "ok": {"type": "boolean"}},
          "required": ["name", "age", "ok"], "additionalProperties": False}
PROMPT = [1, 520, 3100, 77, 902, 15]


def sampled(seed: int, **kwargs) -> SamplingParams:
    kwargs.setdefault("max_tokens", 64)
    return SamplingParams(temperature=1.0, seed=seed, **kwargs)


def test_sampled_json_always_follows_the_schema(make_engine, tokenizer):
    engine = make_engine()
    constraint = OutputConstraint.json_schema(SCHEMA)
    for i in range(12):
        engine.add_request(f"r{i}", PROMPT, sampled(i, constraint=constraint))
    produced = run_to_completion(engine)
    for i in range(12):
        ids = produced[f"r{i}"]
        assert ids[-1] == tokenizer.eos_token_id, "the grammar ends with EOS"
        value = json.loads(tokenizer.decode(ids[:-1]))
        assert set(value) == {"name", "age", "ok"} and 0 <= value["age"] <= 120
        assert len(value["name"]) <= 8 and isinstance(value["ok"], bool)


@pytest.mark.parametrize("constraint, check", [
    (OutputConstraint("regex", r"[0-9]{2}-[a-z]{3}"),
     lambda text: len(text) == 6 and text[:2].isdigit() and text[2] == "-" and text[3:].isalpha()),
    (OutputConstraint.choice(["red", "green", "blue"]), lambda text: text in {"red", "green", "blue"}),
])
def test_regex_and_choice(make_engine, tokenizer, constraint, check):
    engine = make_engine()
    for i in range(6):
        engine.add_request(f"r{i}", PROMPT, sampled(100 + i, constraint=constraint))
    for ids in run_to_completion(engine).values():
        assert check(tokenizer.decode(ids, skip_special_tokens=True))


def test_free_requests_in_the_batch_are_unchanged(make_engine):
    free = SamplingParams(max_tokens=20, temperature=0.8, seed=5, ignore_eos=True)
    alone = make_engine()
    alone.add_request("free", PROMPT, free)
    expected = run_to_completion(alone)["free"]
    mixed = make_engine()
    mixed.add_request("c0", PROMPT, sampled(1, constraint=OutputConstraint("json_object")))
    mixed.add_request("free", PROMPT, free)
    mixed.add_request("c1", PROMPT, sampled(2, constraint=OutputConstraint.json_schema(SCHEMA)))
    assert run_to_completion(mixed)["free"] == expected


@pytest.mark.parametrize("cut", [1, 5, 11])
def test_resumed_constrained_request_continues_identically(make_engine, cut):
    params = sampled(42, constraint=OutputConstraint.json_schema(SCHEMA))
    first = make_engine()
    first.add_request("r", PROMPT, params)
    full = run_to_completion(first)["r"]
    assert len(full) > cut
    second = make_engine()  # another worker: fresh engine, grammar rebuilt from the checkpoint
    second.add_request("r", PROMPT, params, output_token_ids=full[:cut])
    assert full[:cut] + run_to_completion(second)["r"] == full


def test_bad_constraint_is_refused_at_add(make_engine):
    engine = make_engine()
    with pytest.raises(ValueError, match="frobnicate"):
        engine.add_request("r", PROMPT, sampled(1, constraint=OutputConstraint.json_schema(
            {"type": "frobnicate"})))
    assert not engine.has_unfinished()


def test_constraint_without_tokenizer_is_refused(tiny_bpe_model):
    import copy

    from kvfleet.worker.engine.engine import Engine, EngineConfig
    engine = Engine(copy.deepcopy(tiny_bpe_model), EngineConfig(device="cpu", dtype="float32",
                                                                   num_blocks=64))
    with pytest.raises(ValueError, match="tokenizer"):
        engine.add_request("r", PROMPT, sampled(1, constraint=OutputConstraint("json_object")))


def test_logit_bias_moves_greedy_choices(make_engine):
    engine = make_engine()
    base = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    engine.add_request("plain", PROMPT, base)
    engine.add_request("biased", PROMPT, SamplingParams(max_tokens=6, temperature=0.0,
                                                        ignore_eos=True, logit_bias={4242: 100.0}))
    out = run_to_completion(engine)
    assert out["biased"] == [4242] * 6 and out["plain"] != out["biased"]
    banned = out["plain"][0]
    engine.add_request("ban", PROMPT, SamplingParams(max_tokens=1, temperature=0.0,
                                                     logit_bias={banned: -100.0}))
    assert run_to_completion(engine)["ban"][0] != banned


def test_engine_stats_count_constrained_requests_and_compiles(make_engine):
    engine = make_engine(grammar_cache_size=4)
    constraint = OutputConstraint.choice(["red", "green"])
    engine.add_request("a", PROMPT, sampled(1, constraint=constraint))
    engine.add_request("b", PROMPT, sampled(2, constraint=constraint))
    engine.add_request("c", PROMPT, sampled(3))
    stats = engine.stats()
    assert (stats.num_constrained, stats.grammar_compiles, stats.grammar_cache_hits) == (2, 1, 1)
    run_to_completion(engine)
    assert engine.stats().num_constrained == 0
