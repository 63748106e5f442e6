"""The output constraint of a request: from `response_format`, vLLM's `guided_*` fields or
`structured_outputs` (at most one of them), validated before anything is enqueued."""

from __future__ import annotations

import json

from kvfleet.gateway.http.errors import bad_request
from kvfleet.gateway.openai.request_schemas import SamplingRequest
from kvfleet.shared.structured import ConstraintError, OutputConstraint, validate


def request_constraint(request: SamplingRequest) -> tuple[str, OutputConstraint] | None:
    """(the field it came from, the constraint), or None for free text. 400 when two fields ask
    for a constraint or the one asked for does not compile."""
    found = [(field, c) for field, c in _sources(request) if c is not None]
    if len(found) > 1:
        raise bad_request(f"`{found[0][0]}` and `{found[1][0]}` both constrain the output; "
                          "give one of them.", param=found[1][0])
    if not found:
        return None
    checked = check(*found[0])
    if request.min_tokens:
        raise bad_request("`min_tokens` cannot be combined with structured outputs (the grammar "
                          "decides where the answer ends).", param="min_tokens")
    if request.ignore_eos:
        raise bad_request("`ignore_eos` cannot be combined with structured outputs (the answer "
                          "ends with the grammar).", param="ignore_eos")
    return found[0][0], checked


def check(field: str, constraint: OutputConstraint) -> OutputConstraint:
    try:
        validate(constraint)
    except ConstraintError as exc:
        raise bad_request(f"`{field}` cannot be used as a constraint: {exc}", param=field,
                          code="invalid_constraint") from exc
    return constraint


def _sources(request: SamplingRequest):
    response_format = getattr(request, "response_format", None)
    if response_format is not None and response_format.type != "text":
        yield "response_format", (
            OutputConstraint("json_object") if response_format.type == "json_object"
            else OutputConstraint.json_schema(response_format.json_schema.schema_))
    yield "guided_json", _json_schema(request.guided_json, "guided_json")
    yield "guided_regex", (OutputConstraint("regex", request.guided_regex)
                           if request.guided_regex is not None else None)
    yield "guided_choice", (OutputConstraint.choice(request.guided_choice)
                            if request.guided_choice is not None else None)
    yield "guided_grammar", (OutputConstraint("lark", request.guided_grammar)
                             if request.guided_grammar is not None else None)
    so = request.structured_outputs
    if so is not None:
        if so.json_ is not None:
            yield "structured_outputs", _json_schema(so.json_, "structured_outputs.json")
        elif so.regex is not None:
            yield "structured_outputs", OutputConstraint("regex", so.regex)
        elif so.choice is not None:
            yield "structured_outputs", OutputConstraint.choice(so.choice)
        elif so.grammar is not None:
            yield "structured_outputs", OutputConstraint("lark", so.grammar)
        else:
            yield "structured_outputs", OutputConstraint("json_object")


def _json_schema(schema, field: str) -> OutputConstraint | None:
    if schema is None:
        return None
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise bad_request(f"`{field}` is not valid JSON: {exc}", param=field) from exc
    return OutputConstraint.json_schema(schema)
