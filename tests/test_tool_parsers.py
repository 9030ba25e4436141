"""Tool-call parsers (ember.tool_parsers): hermes, llama3_json, mistral and the required-mode
parser on realistic outputs, and the property the chat endpoint relies on: the streamed deltas,
concatenated, equal the non-streamed result for every split of the output into deltas."""

from __future__ import annotations

import json
import re
import string

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ember.registry import ToolParserRegistry
from ember.tool_parsers import ExtractedToolCalls, get_tool_parser, make_tool_parser
from ember.tool_parsers.builtin import (
    HermesToolParser,
    Llama3JsonToolParser,
    MistralToolParser,
    NamedToolCallParser,
    RequiredToolCallParser,
)

WEATHER = {"city": "Paris", "unit": "celsius"}
NESTED = {"query": {"filters": [{"field": "price", "lt": 10.5}, {"tags": ["a", "b"]}],
                    "text": "brace } and bracket ] and quote \" inside"}, "limit": None,
          "flag": True}
UNICODE = {"text": "Grüße, 東京 🌧️", "escaped": "\u00e9"}


def calls_of(result: ExtractedToolCalls) -> list[tuple[str, object]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in result.tool_calls]


def replay(parser_cls, text: str, cuts: list[int]):
    """Stream `text` cut at `cuts` through a fresh parser; the deltas put back together as
    (content or None, [(name, arguments text)]), checking OpenAI's delta shape on the way."""
    parser = parser_cls()
    bounds = [0, *sorted(set(cuts)), len(text)]
    content, calls, previous = [], [], ""
    deltas = []
    for a, b in zip(bounds, bounds[1:], strict=False):
        piece = text[a:b]
        deltas.append(parser.extract_tool_calls_streaming(previous, previous + piece, piece))
        previous += piece
    deltas.append(parser.finish_streaming())
    for delta in filter(None, deltas):
        assert set(delta) <= {"content", "tool_calls"} and delta
        content.append(delta.get("content", ""))
        for tc in delta.get("tool_calls", []):
            if tc["index"] == len(calls):  # a new call: id, type and name come first, once
                assert tc["type"] == "function" and tc["id"] and tc["function"]["name"]
                calls.append([tc["function"]["name"], tc["function"]["arguments"]])
            else:
                assert tc["index"] == len(calls) - 1 and set(tc) == {"index", "function"}
                assert set(tc["function"]) == {"arguments"}
                calls[tc["index"]][1] += tc["function"]["arguments"]
    assert parser.tools_called == bool(calls)
    return "".join(content) or None, [tuple(c) for c in calls]


def full(parser_cls, text: str):
    result = parser_cls().extract_tool_calls(text)
    assert result.tools_called == bool(result.tool_calls)
    return result.content, [(c["function"]["name"], c["function"]["arguments"])
                            for c in result.tool_calls]


def check_every_split(parser_cls, text: str) -> None:
    """Each single cut and character-by-character streaming equal the whole-output parse."""
    expected = full(parser_cls, text)
    assert replay(parser_cls, text, list(range(1, len(text)))) == expected
    for cut in range(len(text) + 1):
        assert replay(parser_cls, text, [cut]) == expected, cut


def hermes(name, args, raw=None):
    body = raw if raw is not None else json.dumps({"name": name, "arguments": args},
                                                  ensure_ascii=False)
    return f"<tool_call>\n{body}\n</tool_call>"


# --------------------------------------------------------------------------------- hermes


def test_hermes_qwen_output_with_text_before_and_after():
    text = ("I'll look that up for you.\n" + hermes("get_weather", WEATHER) + "\n"
            + hermes("search", NESTED) + "\n\nBoth calls are on their way.")
    result = HermesToolParser().extract_tool_calls(text)
    assert result.tools_called
    assert calls_of(result) == [("get_weather", WEATHER), ("search", NESTED)]
    assert result.content == "I'll look that up for you.\nBoth calls are on their way."
    assert all(c["id"].startswith("chatcmpl-tool-") and c["type"] == "function"
               for c in result.tool_calls)
    assert len({c["id"] for c in result.tool_calls}) == 2
    check_every_split(HermesToolParser, text)


def test_hermes_only_calls_has_no_content_and_unicode_survives():
    text = hermes("translate", UNICODE) + "\n" + hermes("noop", {})
    result = HermesToolParser().extract_tool_calls(text)
    assert result.content is None
    assert calls_of(result) == [("translate", UNICODE), ("noop", {})]
    assert "東京" in result.tool_calls[0]["function"]["arguments"]  # as written, not escaped
    check_every_split(HermesToolParser, text)


def test_hermes_arguments_before_name_and_extra_keys():
    body = '{"arguments": {"x": [1, 2]}, "id": 7, "name": "f"}'
    text = f"<tool_call>{body}</tool_call>"
    assert calls_of(HermesToolParser().extract_tool_calls(text)) == [("f", {"x": [1, 2]})]
    check_every_split(HermesToolParser, text)


def test_hermes_unclosed_final_call_counts_when_complete():
    text = 'ok <tool_call>\n{"name": "f", "arguments": {"a": 1}}'
    result = HermesToolParser().extract_tool_calls(text)
    assert calls_of(result) == [("f", {"a": 1})] and result.content == "ok "
    check_every_split(HermesToolParser, text)


@pytest.mark.parametrize("text", [
    "no tools here, just <b>html</b> and a {brace}",
    "<tool_call>not json at all</tool_call>",
    'Answer <tool_call>{"name": 5, "arguments": {}}</tool_call>',
    '<tool_call>{"name": "f", "arguments": "a string"}</tool_call>',
    '<tool_call>{"name": "f"}</tool_call> tail',
    '<tool_call>{"arguments": {}}</tool_call>',
    "text ending in a partial tag <tool_ca",
    '<tool_call>{"name": "f", "arguments": {"a": 1',  # cut short before its name... and args
    "<tool_call>",
    "",
])
def test_hermes_non_calls_are_content(text):
    result = HermesToolParser().extract_tool_calls(text)
    assert result == ExtractedToolCalls(False, [], text or None)
    if text != '<tool_call>{"name": "f", "arguments": {"a": 1':  # streamed already: see below
        check_every_split(HermesToolParser, text)


def test_hermes_malformed_arguments_make_the_whole_output_content():
    # vLLM's rule: a call whose JSON does not parse turns the whole response into content.
    for text in ['<tool_call>{"name": "f", "arguments": {"a": tru}}</tool_call>',
                 hermes("ok", {}) + '<tool_call>{"name": "g", "arguments": {"a": }}</tool_call>',
                 '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>\n<tool_call>oops'
                 "</tool_call>",
                 '<tool_call>{"name": "f", "arguments": {"a": 1}} trailing</tool_call>']:
        assert HermesToolParser().extract_tool_calls(text) == ExtractedToolCalls(False, [], text)


def test_hermes_streaming_sends_the_name_once_then_argument_pieces():
    text = "Sure.\n" + hermes("get_weather", WEATHER)
    parser = HermesToolParser()
    deltas, prev = [], ""
    for piece in re.findall(r".{1,3}", text, re.S):
        deltas.append(parser.extract_tool_calls_streaming(prev, prev + piece, piece))
        prev += piece
    deltas = [d for d in deltas if d]
    first_call = next(d for d in deltas if "tool_calls" in d)["tool_calls"][0]
    assert first_call["function"]["name"] == "get_weather" and first_call["index"] == 0
    # the name goes out as soon as it is known, before the arguments are complete
    assert len(first_call["function"]["arguments"]) < len(json.dumps(WEATHER))
    assert "".join(d.get("content", "") for d in deltas) == "Sure.\n"
    assert not any("<tool" in d.get("content", "") for d in deltas)
    assert parser.finish_streaming() is None


def test_hermes_partial_tag_is_held_back_then_released():
    parser = HermesToolParser()
    assert parser.extract_tool_calls_streaming("", "Hi <tool", "Hi <tool") == {"content": "Hi "}
    assert parser.extract_tool_calls_streaming("Hi <tool", "Hi <tooling", "ing") == {
        "content": "<tooling"}
    parser = HermesToolParser()
    assert parser.extract_tool_calls_streaming("", "Hi <tool_c", "Hi <tool_c") == {
        "content": "Hi "}
    assert parser.finish_streaming() == {"content": "<tool_c"}


def test_hermes_stream_started_mid_text_sends_only_new_text():
    parser = HermesToolParser()
    assert parser.extract_tool_calls_streaming("abc", "abcdef", "def") == {"content": "def"}


# --------------------------------------------------------------------------------- llama3_json


@pytest.mark.parametrize("prefix", ["", "<|python_tag|>", "\n"])
def test_llama3_json_calls(prefix):
    text = prefix + json.dumps({"name": "get_weather", "parameters": WEATHER})
    result = Llama3JsonToolParser().extract_tool_calls(text)
    assert calls_of(result) == [("get_weather", WEATHER)] and result.content is None
    check_every_split(Llama3JsonToolParser, text)


def test_llama3_json_several_calls_separated_by_semicolons_then_text():
    text = ('{"name": "a", "parameters": {"x": 1}}; {"name": "b", "arguments": '
            + json.dumps(NESTED) + "}\n\nDone.")
    result = Llama3JsonToolParser().extract_tool_calls(text)
    assert calls_of(result) == [("a", {"x": 1}), ("b", NESTED)]
    assert result.content == "Done."
    check_every_split(Llama3JsonToolParser, text)


@pytest.mark.parametrize("text", [
    "The weather in Paris is sunny.",
    '{"answer": 42, "name": "not a call"}',           # JSON that is no call
    'Here it is: {"name": "f", "parameters": {}}',    # calls come first in this format
    "<|python_tag|>print('code interpreter')",
    "  ",
])
def test_llama3_json_non_calls_are_content(text):
    assert Llama3JsonToolParser().extract_tool_calls(text) == ExtractedToolCalls(False, [], text)
    check_every_split(Llama3JsonToolParser, text)


# --------------------------------------------------------------------------------- mistral


def test_mistral_array_of_calls_with_content_before():
    calls = [{"name": "get_weather", "arguments": WEATHER}, {"name": "t", "arguments": UNICODE}]
    text = "Let me see. [TOOL_CALLS] " + json.dumps(calls, ensure_ascii=False)
    result = MistralToolParser().extract_tool_calls(text)
    assert calls_of(result) == [("get_weather", WEATHER), ("t", UNICODE)]
    assert result.content == "Let me see. "
    assert all(len(c["id"]) == 9 and c["id"].isalnum() for c in result.tool_calls)
    assert MistralToolParser.needs_special_tokens
    check_every_split(MistralToolParser, text)


def test_mistral_v11_and_v13_calls_name_before_arguments():
    text = ('Checking. [TOOL_CALLS]get_weather{"city": "Paris"}[TOOL_CALLS]search[ARGS] '
            + json.dumps(NESTED) + " Done.")
    result = MistralToolParser().extract_tool_calls(text)
    assert calls_of(result) == [("get_weather", {"city": "Paris"}), ("search", NESTED)]
    assert result.content == "Checking. Done."
    check_every_split(MistralToolParser, text)


@pytest.mark.parametrize("text", [
    "[TOOL_CALLS] not a list",
    "[TOOL_CALLS]get_weather",
    "[TOOL_CALLS]get weather{}",
    '[TOOL_CALLS]f{"a": }',
    "[TOOL_CALLS][]",
    '[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {bad}}]',
    "no calls, but [brackets] and [TOOL_CALL",
])
def test_mistral_non_calls_are_content(text):
    assert MistralToolParser().extract_tool_calls(text) == ExtractedToolCalls(False, [], text)


# --------------------------------------------------------------------------------- required


def test_required_mode_parser_reads_the_constrained_array():
    text = json.dumps([{"name": "a", "parameters": {"x": 1}}, {"name": "b", "parameters": {}}])
    result = RequiredToolCallParser().extract_tool_calls(text)
    assert calls_of(result) == [("a", {"x": 1}), ("b", {})] and result.content is None
    check_every_split(RequiredToolCallParser, text)


def test_named_function_parser_streams_the_arguments_object():
    def named():
        return NamedToolCallParser(name="get_weather")

    text = '\n {"city": "Paris",\n "unit": "c"} \n'
    result = named().extract_tool_calls(text)
    assert result.tools_called and result.content is None
    assert calls_of(result) == [("get_weather", {"city": "Paris", "unit": "c"})]
    check_every_split(named, text)
    assert replay(named, "  ", [1]) == (None, [])


# --------------------------------------------------------------------------------- registry


def test_builtins_are_registered_and_resolve_lazily():
    assert {"hermes", "llama3_json", "mistral"} <= set(ToolParserRegistry.names())
    assert get_tool_parser("hermes") is HermesToolParser
    assert isinstance(make_tool_parser("mistral"), MistralToolParser)
    with pytest.raises(ValueError, match="hermes"):
        get_tool_parser("no_such_parser")


# --------------------------------------------------------------------------------- properties

_json_leaf = st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.floats(
    allow_nan=False, allow_infinity=False, width=32) | st.text(max_size=8)
_json = st.recursive(_json_leaf, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
    st.text(max_size=5), inner, max_size=3), max_leaves=8)
_args = st.dictionaries(st.text(max_size=6), _json, max_size=4)
_names = st.text(string.ascii_letters + "_", min_size=1, max_size=10)
# content with the characters that could confuse the scanners
_content = st.lists(st.sampled_from(list("ab <>/{}[];,\"\n") + [
    "<tool_call>", "[TOOL_CALLS]", "</tool_call>", "<tool_", "é", "🙂"]), max_size=12).map("".join)


def _dump(obj) -> str:
    return json.dumps(obj, ensure_ascii=False)


@st.composite
def _outputs(draw, kind):
    calls = draw(st.lists(st.tuples(_names, _args), min_size=0, max_size=3))
    key = draw(st.sampled_from(["arguments", "parameters"]))
    if kind == "hermes":
        parts = [draw(_content.filter(lambda s: "<tool_call>" not in s))]
        for name, args in calls:
            sep = draw(st.sampled_from(["", "\n", " "]))
            parts += [hermes(name, None, _dump({"name": name, key: args})), sep]
        parts.append(draw(_content.filter(lambda s: "<tool_call>" not in s)))
        text = "".join(parts)
    elif kind == "llama3_json":
        if not calls:
            return draw(_content.filter(lambda s: not s.lstrip().startswith(("{", "<|")))), []
        text = draw(st.sampled_from(["", "<|python_tag|>"])) + draw(
            st.sampled_from(["; ", ";"])).join(_dump({"name": n, key: a}) for n, a in calls)
    elif kind == "mistral":
        before = draw(_content.filter(lambda s: "[TOOL_CALLS]" not in s))
        if not calls:
            return before, []
        if draw(st.booleans()):
            text = before + "[TOOL_CALLS]" + _dump([{"name": n, "arguments": a} for n, a in calls])
        else:  # v11 / v13 tokenizers: one call per marker, the name outside the JSON
            text = before + "".join(f"[TOOL_CALLS]{n}{draw(st.sampled_from(['', '[ARGS]']))}"
                                    f"{_dump(a)}" for n, a in calls)
    else:  # required
        if not calls:
            return "[]", []
        text = _dump([{"name": n, "parameters": a} for n, a in calls])
    return text, calls


_PARSERS = {"hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser,
            "mistral": MistralToolParser, "required": RequiredToolCallParser}
_SETTINGS = settings(max_examples=60, deadline=None,
                     suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


@pytest.mark.parametrize("kind", list(_PARSERS))
@_SETTINGS
@given(data=st.data())
def test_streamed_equals_whole_for_every_split_of_wellformed_output(kind, data):
    text, calls = data.draw(_outputs(kind))
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=len(text) + 1))
    expected = full(_PARSERS[kind], text)
    assert replay(_PARSERS[kind], text, cuts) == expected
    # every call the model wrote is found, with its arguments
    assert [(n, json.loads(a)) for n, a in expected[1]] == [(n, a) for n, a in calls]


_noise = st.lists(st.sampled_from(list('ab {}[]":,;\n\\') + [
    "<tool_call>", "</tool_call>", "[TOOL_CALLS]", "<|python_tag|>", '"name"', '"arguments"',
    '"parameters"', '"f"', "{}", "é"]), max_size=30).map("".join)


@st.composite
def _mutated(draw, kind):
    """A well-formed output with a few characters deleted, replaced or inserted: mostly broken
    calls, some still (or newly) valid."""
    text, _ = draw(_outputs(kind))
    for _ in range(draw(st.integers(1, 3))):
        at = draw(st.integers(0, len(text)))
        cut = draw(st.integers(0, 2))
        text = text[:at] + draw(_noise.filter(lambda s: len(s) < 4)) + text[at + cut:]
    return text


@pytest.mark.parametrize("kind", list(_PARSERS))
@_SETTINGS
@given(data=st.data())
def test_streamed_equals_whole_for_any_text_unless_a_streamed_call_went_bad(kind, data):
    """On arbitrary text the parsers never raise, and streaming agrees with the whole-output
    parse except where a call was already streamed before its text turned out malformed."""
    text = data.draw(_noise | _mutated(kind))
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=len(text) + 1))
    parser_cls = _PARSERS[kind]
    content, calls = full(parser_cls, text)
    streamed = replay(parser_cls, text, cuts)
    if calls or not streamed[1]:  # no call streamed that the whole parse rejected
        assert streamed == (content, calls)
    else:
        assert content == (text or None)
