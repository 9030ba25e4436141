"""JSON schemas that force a valid tool call (structured outputs for `tool_choice`), and the
parsing of the outputs they constrain.

- ``tool_choice="required"``: an array of one or more ``{"name": <a tool's name>,
  "parameters": <that tool's parameters>}`` (one anyOf branch per tool, so each name goes with
  its own parameters); `$defs`/`definitions` of the tools move to the top, where their `$ref`s
  point (two tools defining one name differently is a ValueError).
- a named function (``{"type": "function", "function": {"name": …}}``): its parameters object.

Tools are OpenAI's (``{"type": "function", "function": {"name", "parameters", …}}``) as dicts or
pydantic models. The schemas are new dicts: the request's tools are not modified.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Sequence
from typing import Any

from ember.tool_parsers.abstract import make_tool_call_id, tool_call

_EMPTY_PARAMETERS = {"type": "object", "properties": {}}
_DEF_KEYS = ("$defs", "definitions")


_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names


def validate_tools(tools: Sequence[Any] | None) -> None:
    """Check a request's tools (a ValueError naming the tool and the problem, for a 400): each
    is ``{"type": "function", "function": {"name", "parameters"?}}`` with a name of at most 64
    letters, digits, '_' or '-', names are unique, and parameters (if given) are a JSON schema
    object. Whether a schema's keywords are supported is the grammar backend's to say, when
    tool_choice makes one compile it."""
    seen: set[str] = set()
    for i, tool in enumerate(tools or ()):
        if hasattr(tool, "model_dump"):
            tool = tool.model_dump(exclude_none=True)
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise ValueError(f"{where}: only tools of type 'function' are supported")
        fn = _function(tool)
        name = fn["name"]
        if not _NAME.fullmatch(name):
            raise ValueError(f"{where}: function name {name!r} must be 1-64 letters, digits, "
                             "'_' or '-'")
        if name in seen:
            raise ValueError(f"{where}: function name {name!r} is given twice")
        seen.add(name)
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise ValueError(f"{where} ({name}): parameters must be a JSON schema object, got "
                             f"{type(params).__name__}")
        if params and params.get("type", "object") != "object":
            raise ValueError(f"{where} ({name}): parameters must describe an object "
                             f"(type 'object'), got type {params.get('type')!r}")


def _function(tool: Any) -> dict[str, Any]:
    if hasattr(tool, "model_dump"):
        tool = tool.model_dump(exclude_none=True)
    fn = tool.get("function", tool) if isinstance(tool, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ValueError(f"a tool must be {{'type': 'function', 'function': {{'name': ...}}}}, "
                         f"got {tool!r}")
    return fn


def _parameters(fn: dict[str, Any]) -> dict[str, Any]:
    params = fn.get("parameters")
    return copy.deepcopy(params) if params else dict(_EMPTY_PARAMETERS)


def required_tool_calls_schema(tools: Sequence[Any]) -> dict[str, Any]:
    """The schema of one or more calls of `tools` (for ``tool_choice="required"``)."""
    if not tools:
        raise ValueError('tool_choice="required" needs at least one tool')
    branches, defs = [], {key: {} for key in _DEF_KEYS}
    for tool in tools:
        fn = _function(tool)
        params = _parameters(fn)
        for key in _DEF_KEYS:
            for name, sub in (params.pop(key, None) or {}).items():
                if name in defs[key] and defs[key][name] != sub:
                    raise ValueError(f"tools define {key}/{name} differently; "
                                     'tool_choice="required" needs one definition')
                defs[key][name] = sub
        branches.append({"properties": {"name": {"type": "string", "enum": [fn["name"]]},
                                        "parameters": params},
                         "required": ["name", "parameters"]})
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": {"type": "object", "anyOf": branches}}
    schema.update({key: value for key, value in defs.items() if value})
    return schema


def named_tool_call_schema(tools: Sequence[Any], name: str) -> dict[str, Any]:
    """The schema of a call of the tool named `name`: its parameters object."""
    for tool in tools or ():
        fn = _function(tool)
        if fn["name"] == name:
            return _parameters(fn)
    known = ", ".join(_function(t)["name"] for t in tools or ()) or "none"
    raise ValueError(f"tool_choice names function {name!r}, which is not among the request's "
                     f"tools ({known})")


def tool_call_json_schema(tools: Sequence[Any] | None, tool_choice: Any) -> dict[str, Any] | None:
    """The schema to constrain the output with for this `tool_choice`, or None when it does not
    force a call ("auto", "none", None)."""
    if hasattr(tool_choice, "model_dump"):
        tool_choice = tool_choice.model_dump(exclude_none=True)
    if tool_choice == "required":
        return required_tool_calls_schema(tools or [])
    if isinstance(tool_choice, dict):
        fn = tool_choice.get("function") or {}
        if tool_choice.get("type") != "function" or not isinstance(fn.get("name"), str):
            raise ValueError(f"tool_choice must be 'none', 'auto', 'required' or "
                             f"{{'type': 'function', 'function': {{'name': ...}}}}, got "
                             f"{tool_choice!r}")
        return named_tool_call_schema(tools or [], fn["name"])
    if tool_choice in (None, "auto", "none"):
        return None
    raise ValueError(f"tool_choice {tool_choice!r} is not 'none', 'auto', 'required' or a "
                     "named function")


def required_tool_calls(output: str) -> list[dict[str, Any]]:
    """The calls (OpenAI dicts) in an output constrained by `required_tool_calls_schema`, with
    the arguments as written (what RequiredToolCallParser streams). ValueError if it is not a
    list of calls (an output cut short by max_tokens)."""
    from ember.tool_parsers.builtin import RequiredToolCallParser

    result = RequiredToolCallParser().extract_tool_calls(output)
    if not result.tools_called:
        raise ValueError(f"not a JSON array of tool calls: {output[:200]!r}")
    return result.tool_calls


def named_tool_call(name: str, output: str) -> dict[str, Any]:
    """The call in an output constrained by `named_tool_call_schema` (the arguments as written)."""
    return tool_call(name, output.strip(), make_tool_call_id())
