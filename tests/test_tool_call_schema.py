"""The JSON schemas that force a valid tool call (ember.tool_parsers.schema), checked with the
`jsonschema` package against sample calls, valid and invalid, and the parsing of the outputs they
constrain."""

from __future__ import annotations

import copy
import json

import jsonschema
import pytest

from ember.tool_parsers import (
    named_tool_call,
    named_tool_call_schema,
    required_tool_calls,
    required_tool_calls_schema,
    tool_call_json_schema,
    validate_tools,
)
from ember.tool_parsers.builtin import RequiredToolCallParser

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
        "required": ["city"], "additionalProperties": False}}}
ORDER = {"type": "function", "function": {
    "name": "place_order",
    "parameters": {"type": "object", "properties": {
        "items": {"type": "array", "minItems": 1, "items": {"$ref": "#/$defs/Item"}}},
        "required": ["items"],
        "$defs": {"Item": {"type": "object", "properties": {
            "sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1}},
            "required": ["sku", "qty"]}}}}}
NO_PARAMS = {"type": "function", "function": {"name": "ping"}}
TOOLS = [WEATHER, ORDER, NO_PARAMS]


def valid(schema, instance) -> bool:
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema).is_valid(instance)


@pytest.mark.parametrize("calls", [
    [{"name": "get_weather", "parameters": {"city": "Paris"}}],
    [{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "c"}},
     {"name": "place_order", "parameters": {"items": [{"sku": "A1", "qty": 2}]}},
     {"name": "ping", "parameters": {}}],
])
def test_required_schema_accepts_valid_calls(calls):
    assert valid(required_tool_calls_schema(TOOLS), calls)


@pytest.mark.parametrize("calls", [
    [],                                                                   # at least one call
    {"name": "get_weather", "parameters": {"city": "Paris"}},             # not an array
    [{"name": "get_time", "parameters": {}}],                             # unknown tool
    [{"name": "get_weather", "parameters": {"unit": "c"}}],               # missing argument
    [{"name": "get_weather", "parameters": {"city": "P", "unit": "k"}}],  # not in the enum
    [{"name": "get_weather", "parameters": {"city": "P", "x": 1}}],       # no extra argument
    [{"name": "get_weather"}],                                            # no parameters
    [{"name": "place_order", "parameters": {"items": [{"sku": "A1", "qty": 0}]}}],  # via $ref
    [{"name": "place_order", "parameters": {"city": "Paris"}}],           # another tool's args
])
def test_required_schema_rejects_invalid_calls(calls):
    assert not valid(required_tool_calls_schema(TOOLS), calls)


def test_required_schema_hoists_defs_and_leaves_the_tools_alone():
    before = copy.deepcopy(TOOLS)
    schema = required_tool_calls_schema(TOOLS)
    assert TOOLS == before
    assert schema["$defs"] == {"Item": ORDER["function"]["parameters"]["$defs"]["Item"]}
    assert schema["items"]["anyOf"][2]["properties"]["parameters"] == {
        "type": "object", "properties": {}}
    clash = copy.deepcopy(ORDER)
    clash["function"]["name"] = "other"
    clash["function"]["parameters"]["$defs"]["Item"] = {"type": "string"}
    with pytest.raises(ValueError, match="Item"):
        required_tool_calls_schema([ORDER, clash])
    with pytest.raises(ValueError, match="at least one tool"):
        required_tool_calls_schema([])


def test_named_schema_is_the_functions_parameters():
    schema = named_tool_call_schema(TOOLS, "place_order")
    assert valid(schema, {"items": [{"sku": "B", "qty": 3}]})
    assert not valid(schema, {"items": []})
    assert not valid(schema, [{"name": "place_order", "parameters": {}}])
    assert named_tool_call_schema(TOOLS, "ping") == {"type": "object", "properties": {}}
    with pytest.raises(ValueError, match="'nope'.*get_weather, place_order, ping"):
        named_tool_call_schema(TOOLS, "nope")


def test_tool_choice_dispatch():
    assert tool_call_json_schema(TOOLS, "required") == required_tool_calls_schema(TOOLS)
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert tool_call_json_schema(TOOLS, named) == WEATHER["function"]["parameters"]
    for choice in ("auto", "none", None):
        assert tool_call_json_schema(TOOLS, choice) is None
    for bad in ("always", {"type": "function"}, {"function": {"name": "get_weather"}}):
        with pytest.raises(ValueError, match="tool_choice"):
            tool_call_json_schema(TOOLS, bad)


def test_tools_as_pydantic_models():
    from pydantic import BaseModel

    class Function(BaseModel):
        name: str
        parameters: dict | None = None

    class Tool(BaseModel):
        type: str = "function"
        function: Function

    tools = [Tool(function=Function(**WEATHER["function"]))]
    assert tool_call_json_schema(tools, "required") == required_tool_calls_schema([WEATHER])


def test_constrained_outputs_parse_into_calls():
    output = json.dumps([{"name": "get_weather", "parameters": {"city": "Zürich"}},
                         {"name": "ping", "parameters": {}}], ensure_ascii=False)
    assert valid(required_tool_calls_schema(TOOLS), json.loads(output))
    calls = required_tool_calls(output)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Zürich"}), ("ping", {})]
    assert "Zürich" in calls[0]["function"]["arguments"]
    # the streaming parser of the same output agrees
    streamed = RequiredToolCallParser().extract_tool_calls(output)
    assert [json.loads(c["function"]["arguments"]) for c in streamed.tool_calls] == [
        {"city": "Zürich"}, {}]
    call = named_tool_call("get_weather", ' {"city": "Paris"} ')
    assert call["type"] == "function" and call["id"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}


def test_validate_tools_names_the_tool_and_the_problem():
    validate_tools(TOOLS)
    validate_tools(None)
    for tools, match in [
        ([{"type": "code_interpreter"}], r"tools\[0\]: only tools of type 'function'"),
        ([WEATHER, {"type": "function", "function": {}}], r"a tool must be"),
        ([{"type": "function", "function": {"name": "has space"}}], r"'has space' must be"),
        ([WEATHER, WEATHER], r"tools\[1\]: function name 'get_weather' is given twice"),
        ([{"type": "function", "function": {"name": "f", "parameters": "x"}}],
         r"tools\[0\] \(f\): parameters must be a JSON schema object"),
        ([{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}],
         r"must describe an object"),
    ]:
        with pytest.raises(ValueError, match=match):
            validate_tools(tools)
