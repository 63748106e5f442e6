"""Request schemas of tool calling and structured outputs (OpenAI's, plus vLLM's `guided_*` and
`structured_outputs` extras): they validate shapes; gateway/openai/constraints.py turns them into
the one OutputConstraint the worker enforces."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

FUNCTION_NAME = r"^[a-zA-Z0-9_.\-]{1,64}$"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)


class FunctionDefinition(_Strict):
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; none = no arguments
    strict: bool | None = None  # kvfleet always constrains a forced call to the schema


class ToolDefinition(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCallIn(_Strict):
    name: str
    arguments: str  # JSON text, as the API returned it


class ToolCallIn(_Strict):
    """A call in an assistant message of the conversation (one the model made earlier)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCallIn


class JsonSchemaFormat(_Strict):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | bool = Field(default_factory=dict, alias="schema")
    strict: bool | None = None  # always strict: the grammar is the schema


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("`json_schema` is required when `type` is `json_schema`")
        return self


class StructuredOutputs(_Strict):
    """vLLM's `structured_outputs`: exactly one of these."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # an llguidance Lark grammar
    json_object: bool | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputs:
        given = [k for k in ("json_", "regex", "choice", "grammar") if getattr(self, k) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError("give exactly one of `json`, `regex`, `choice`, `grammar`, "
                             "`json_object`")
        return self
