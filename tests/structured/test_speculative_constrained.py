"""Constrained requests with speculation: each verified row is masked by the grammar as it
stands after the proposals before it, so the answers are those of plain constrained decoding,
greedy and sampled; proposals the grammar refuses are cut there, never sampled."""

from __future__ import annotations

import pytest

from kvfleet.shared.structured import OutputConstraint
from kvfleet.shared.wire import SamplingParams
from tests.engine.tiny_models import run_to_completion

PROMPT = [1, 520, 3100, 77, 902, 15]
CONSTRAINTS = [
    OutputConstraint("regex", r"(abc ){6}[0-9]{3}"),  # repeats: n-gram proposals hit
    OutputConstraint("json_object"),
    OutputConstraint.choice(["alpha beta gamma", "alpha beta delta"]),
]
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
        "adaptive": False}


def submit(engine) -> dict[str, list[int]]:
    for i, constraint in enumerate(CONSTRAINTS):
        for j, params in enumerate([
                SamplingParams(max_tokens=48, temperature=0.0, constraint=constraint),
                SamplingParams(max_tokens=48, temperature=1.0, seed=40 + i, constraint=constraint),
                SamplingParams(max_tokens=48, temperature=0.7, seed=50 + i, ignore_eos=True)]):
            engine.add_request(f"r{i}-{j}", PROMPT + [i], params)
    return run_to_completion(engine)


@pytest.mark.parametrize("spec", [SPEC, {**SPEC, "method": "suffix"}], ids=["ngram", "suffix"])
def test_constrained_answers_are_those_of_plain_decoding(make_engine, tokenizer, spec):
    plain = submit(make_engine())
    speculative = make_engine(speculative_config=spec)
    got = submit(speculative)
    assert got == plain
    stats = speculative.speculation.speculator.stats
    assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0, stats
    text = tokenizer.decode(got["r0-0"], skip_special_tokens=True)
    assert text.startswith("abc abc abc abc abc abc ")


def test_a_stop_string_inside_a_verified_step_ends_the_answer_there(make_engine, tokenizer):
    """Several tokens accepted in one step: the stop string is looked for after each, and the
    tokens after the one that completes it are dropped, as plain decoding never made them."""
    constraint = OutputConstraint("regex", r"(abc ){6}[0-9]{3}")

    def answers(engine):
        for i, (stop, max_tokens) in enumerate([
                ([f"c {digit}" for digit in "0123456789"], 48),  # at the first digit
                (["abc abc abc abc abc"], 48),  # after the fifth "abc"
                ([], 9)]):  # max_tokens inside a step
            engine.add_request(f"s{i}", PROMPT + [i], SamplingParams(
                max_tokens=max_tokens, temperature=0.0, constraint=constraint, stop=stop))
        return run_to_completion(engine)

    plain = answers(make_engine())
    speculative = make_engine(speculative_config=SPEC)
    assert answers(speculative) == plain
    assert speculative.speculation.speculator.stats.num_accepted_tokens > 0
    assert tokenizer.decode(plain["s1"]).endswith("abc abc abc abc abc")
    assert len(plain["s2"]) == 9
