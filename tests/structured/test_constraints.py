"""The constraint contract: its wire form, its grammar text, and validation without a tokenizer."""

from __future__ import annotations

import pytest

from kvfleet.shared.wire import GenerationRequest, SamplingParams
from kvfleet.shared.structured import ConstraintError, OutputConstraint, grammar_of, validate


def test_constraint_travels_inside_the_request_record():
    params = SamplingParams(constraint=OutputConstraint.json_schema({"type": "integer"}),
                            logit_bias={17: -100.0, 5: 2.5})
    request = GenerationRequest("r1", "m", [1, 2, 3], params)
    back = GenerationRequest.unpack(request.pack())
    assert back.params.constraint == params.constraint
    assert back.params.logit_bias == {17: -100.0, 5: 2.5}
    assert GenerationRequest.unpack(GenerationRequest("r2", "m", [1], SamplingParams()).pack()
                                    ).params.constraint is None


def test_equal_schemas_give_one_grammar_text():
    a = OutputConstraint.json_schema({"type": "object", "properties": {"a": {"type": "string"}}})
    b = OutputConstraint.json_schema({"type": "object", "properties": {"a": {"type": "string"}}})
    assert a == b and grammar_of(a) == grammar_of(b)


def test_property_order_is_the_schemas():
    """Generated objects list properties in the order the client's schema gives them."""
    schema = {"type": "object", "properties": {"zeta": {"type": "integer"},
                                               "alpha": {"type": "integer"}}}
    assert OutputConstraint.json_schema(schema).spec.index("zeta") < \
        OutputConstraint.json_schema(schema).spec.index("alpha")


@pytest.mark.parametrize("constraint", [
    OutputConstraint.json_schema({"type": "object", "properties": {"x": {"type": "number"}}}),
    OutputConstraint("json_object"),
    OutputConstraint("regex", r"\d{3}-[a-z]+"),
    OutputConstraint.choice(["yes", "no", 'say "maybe"']),
    OutputConstraint("lark", 'start: "<" NAME ">"\nNAME: /[a-z]+/'),
])
def test_valid_constraints_pass(constraint):
    validate(constraint)


@pytest.mark.parametrize("constraint, words", [
    (OutputConstraint.json_schema({"type": "frobnicate"}), "frobnicate"),
    (OutputConstraint("json_schema", "{not json"), "not valid JSON"),
    (OutputConstraint("regex", "(unclosed"), "unclosed"),
    (OutputConstraint("choice", "[]"), "non-empty"),
    (OutputConstraint("lark", "start: missing_rule"), "missing_rule"),
])
def test_invalid_constraints_are_named(constraint, words):
    with pytest.raises(ConstraintError, match=words):
        validate(constraint)


def test_unknown_kind_from_the_wire_is_refused():
    with pytest.raises(ConstraintError):
        OutputConstraint.from_dict({"kind": "xml", "spec": ""})
