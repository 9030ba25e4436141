"""Tool calling and reasoning output on the chat endpoint, through the official openai client:
"required" and named functions always parse (structured outputs force them), "auto" reads what
the model writes with --tool-call-parser, --reasoning-parser splits reasoning_content off;
streamed deltas add up to the non-streamed response.

The default model does not call tools by itself, so "auto" and reasoning outputs are forced with
guided_regex to what a tool-calling / reasoning model writes; the parsing is what is tested.
"""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest
from server_utils import MODEL_NAME, ServerThread, shared_server

from ember.entrypoints.openai.api_server import build_app
from ember.entrypoints.openai.chat_outputs import ServerParsers

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"]}}}
TOOLS = [WEATHER, TIME]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def _client(parsers: ServerParsers):
    app = build_app(shared_server().engine, [MODEL_NAME], shutdown_engine_on_exit=False,
                    parsers=parsers)
    thread = ServerThread(app).start()
    return thread, openai.OpenAI(base_url=thread.base_url + "/v1", api_key="none",
                                 max_retries=0)


@pytest.fixture(scope="module")
def tools_client():
    thread, client = _client(ServerParsers(tool_call_parser="hermes",
                                           enable_auto_tool_choice=True))
    yield client
    thread.stop()


@pytest.fixture(scope="module")
def reasoning_client():
    thread, client = _client(ServerParsers(reasoning_parser="qwen3"))
    yield client
    thread.stop()


def _streamed(client, **kwargs) -> tuple[str, str, list[dict], str]:
    """(content, reasoning, calls, finish_reason) put together from a stream's deltas."""
    content, reasoning, calls, reason = "", "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        delta = choice.delta
        content += delta.content or ""
        reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
        for call in delta.tool_calls or []:
            entry = calls.setdefault(call.index, {"id": None, "name": "", "arguments": ""})
            entry["id"] = entry["id"] or call.id
            if call.function is not None:
                entry["name"] += call.function.name or ""
                entry["arguments"] += call.function.arguments or ""
        reason = choice.finish_reason or reason
    return content, reasoning, [calls[i] for i in sorted(calls)], reason


def _check_calls(calls: list[dict]) -> None:
    assert calls
    for call in calls:
        assert call["name"] in SCHEMAS
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


def _as_dicts(message) -> list[dict]:
    return [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
            for c in message.tool_calls or []]


@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                 "function": {"name": "get_time"}}],
                         ids=["required", "named"])
def test_forced_tool_calls_always_parse(tools_client, choice):
    kwargs = dict(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, tool_choice=choice,
                  max_tokens=120, temperature=0)
    full = tools_client.chat.completions.create(**kwargs)
    calls = _as_dicts(full.choices[0].message)
    _check_calls(calls)
    if isinstance(choice, dict):
        assert [c["name"] for c in calls] == ["get_time"]
        assert full.choices[0].finish_reason == "stop"
    else:
        assert full.choices[0].finish_reason == "tool_calls"
    content, _, streamed, reason = _streamed(tools_client, **kwargs)
    assert [(c["name"], c["arguments"]) for c in streamed] == [
        (c["name"], c["arguments"]) for c in calls]
    assert all(c["id"] for c in streamed)
    assert reason == full.choices[0].finish_reason


def test_auto_tool_calls_are_parsed_from_the_text(tools_client):
    text = ('Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
            '\n</tool_call>')
    kwargs = dict(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, max_tokens=80,
                  temperature=0, extra_body={"guided_regex": re.escape(text)})
    full = tools_client.chat.completions.create(**kwargs)
    message = full.choices[0].message
    assert message.content == "Let me check."
    assert _as_dicts(message)[0]["name"] == "get_weather"
    assert json.loads(_as_dicts(message)[0]["arguments"]) == {"city": "Paris"}
    assert full.choices[0].finish_reason == "tool_calls"
    content, _, streamed, reason = _streamed(tools_client, **kwargs)
    assert content == "Let me check." and reason == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed] == [
        ("get_weather", {"city": "Paris"})]


def test_auto_needs_the_server_flags(server_without_parsers=None):
    client = openai.OpenAI(base_url=shared_server().base_url + "/v1", api_key="none",
                           max_retries=0)
    with pytest.raises(openai.BadRequestError, match="enable-auto-tool-choice"):
        client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS,
                                       max_tokens=2)
    out = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS,
                                         tool_choice="none", max_tokens=3)
    assert out.choices[0].message.content and not out.choices[0].message.tool_calls


def test_bad_tool_choices_are_400(tools_client):
    for choice in [{"type": "function", "function": {"name": "nope"}}]:
        with pytest.raises(openai.BadRequestError, match="nope"):
            tools_client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES,
                                                 tools=TOOLS, tool_choice=choice, max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="tool_choice"):
        tools_client.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, tool_choice="required",
            max_tokens=2, extra_body={"guided_regex": "a"})


def test_reasoning_is_split_from_the_answer(reasoning_client):
    text = "<think>\nThe capital is well known.\n</think>\n\nParis."
    kwargs = dict(model=MODEL_NAME, messages=MESSAGES, max_tokens=60, temperature=0,
                  extra_body={"guided_regex": re.escape(text)})
    full = reasoning_client.chat.completions.create(**kwargs)
    message = full.choices[0].message
    reasoning = (message.model_extra or {}).get("reasoning_content")
    assert "The capital is well known." in reasoning and "<think>" not in reasoning
    assert message.content.strip() == "Paris."
    content, streamed_reasoning, _, _ = _streamed(reasoning_client, **kwargs)
    assert streamed_reasoning == reasoning and content == message.content


def test_unknown_parsers_are_refused_at_start():
    with pytest.raises(ValueError):
        ServerParsers(tool_call_parser="no-such-parser").check()
    with pytest.raises(ValueError):
        ServerParsers(reasoning_parser="no-such-parser").check()
    with pytest.raises(ValueError, match="tool-call-parser"):
        ServerParsers(enable_auto_tool_choice=True).check()
