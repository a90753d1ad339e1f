"""The OpenAI API's agent fields as pydantic models: tools, tool_choice, response_format,
the vLLM / SGLang structured-output extensions, and the tool calls of a response.

Every model forbids unknown fields, like the request models (see openai_types.py): a field
that is not honoured must be a 400 naming it, never dropped.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class FunctionDefinition(_Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; absent = no parameters
    # true: calls are held to the schema under tool_choice "auto" too (gateway/agents.py); a
    # forced call (required / named) is held to it either way
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class JsonSchemaSpec(_Strict):
    name: str = "response"
    description: str | None = None
    # `schema` shadows a BaseModel attribute, hence the alias.
    json_schema: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None  # the schema is enforced by the grammar engine either way


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaSpec | None = None
    # structural_tag (vLLM / SGLang): xgrammar's `format` object, or the legacy form.
    format: dict[str, Any] | None = None
    structures: list[dict[str, Any]] | None = None
    triggers: list[str] | None = None


class StructuredOutputs(_Strict):
    """vLLM's `structured_outputs` object (the successor of the `guided_*` fields)."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    # Accepted only at their defaults: the grammar engine has no such switches.
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None


# ---- responses ----


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, as the OpenAI API sends it


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionCallDelta(BaseModel):
    name: str | None = Field(default=None, exclude_if=lambda v: v is None)
    arguments: str = ""


class ToolCallDelta(BaseModel):
    """One piece of a streamed call: the first carries id, type and name, the rest only
    `index` and the next characters of `arguments` (the OpenAI streaming shape)."""

    index: int
    id: str | None = Field(default=None, exclude_if=lambda v: v is None)
    type: Literal["function"] | None = Field(default=None, exclude_if=lambda v: v is None)
    function: FunctionCallDelta
