"""Tool-call parsers: turn a model's output into OpenAI tool calls, whole or streamed.

The contract is `ToolParser` (abstract); the built-ins `hermes`, `llama3_json` and `mistral`
(builtin) share one incremental scanner (scanner); `schema` builds the JSON schemas that force a
valid call for ``tool_choice="required"`` or a named function. Parsers are resolved by name
through ember.registry.ToolParserRegistry (plugin hook ``ember_register_tool_parsers``).
Importing this package imports only the standard library.

How a chat endpoint uses them (one parser object per response choice)::

    validate_tools(request.tools)                       # a ValueError is the 400
    schema = tool_call_json_schema(request.tools, request.tool_choice)
    # schema is not None ("required" / a named function): constrain the output with it, then
    # parse with RequiredToolCallParser() / NamedToolCallParser(name=...) (ember.tool_parsers
    # .builtin); for "auto" with --tool-call-parser NAME: make_tool_parser(NAME, tokenizer).
    result = parser.extract_tool_calls(text, request.tools)       # whole response
    delta = parser.extract_tool_calls_streaming(prev, prev + piece, piece)   # each piece
    last = parser.finish_streaming()                                         # once, at the end
    finish_reason = "tool_calls" if parser.tools_called else ...

With a reasoning parser too, feed the tool parser only the reasoning parser's `content`.
"""

from __future__ import annotations

from typing import Any

from ember.tool_parsers.abstract import ExtractedToolCalls, ToolParser, make_tool_call_id
from ember.tool_parsers.schema import (
    named_tool_call,
    named_tool_call_schema,
    required_tool_calls,
    required_tool_calls_schema,
    tool_call_json_schema,
    validate_tools,
)


def get_tool_parser(name: str) -> type[ToolParser]:
    """The parser class registered as `name` (a ValueError lists the known names)."""
    from ember.registry import ToolParserRegistry

    return ToolParserRegistry.resolve(name)


def make_tool_parser(name: str, tokenizer: Any = None) -> ToolParser:
    """A fresh parser (one per response: streaming keeps state)."""
    return get_tool_parser(name)(tokenizer)


__all__ = [
    "ExtractedToolCalls",
    "ToolParser",
    "get_tool_parser",
    "make_tool_parser",
    "make_tool_call_id",
    "named_tool_call",
    "named_tool_call_schema",
    "required_tool_calls",
    "required_tool_calls_schema",
    "tool_call_json_schema",
    "validate_tools",
]
