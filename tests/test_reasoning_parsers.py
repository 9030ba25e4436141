"""Reasoning parsers (ember.reasoning): qwen3 and deepseek_r1 on realistic outputs, where the
reasoning starts (the output, the prompt, the class default), and streamed == whole for every
split of the output into deltas."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ember.reasoning import get_reasoning_parser, make_reasoning_parser
from ember.reasoning.builtin import DeepSeekR1ReasoningParser, Qwen3ReasoningParser
from ember.registry import ReasoningParserRegistry

QWEN3_PROMPT_THINKING = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n"
QWEN3_PROMPT_NO_THINKING = ("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
                            "<think>\n\n</think>\n\n")
# an earlier turn's reasoning in the history does not open a block
HISTORY = "<|im_start|>assistant\n<think>\nold\n</think>\n\nold answer<|im_end|>\n"


def replay(parser, text: str, cuts: list[int]) -> tuple[str | None, str | None]:
    bounds = [0, *sorted(set(cuts)), len(text)]
    out = {"reasoning_content": "", "content": ""}
    previous = ""
    deltas = []
    for a, b in zip(bounds, bounds[1:], strict=False):
        piece = text[a:b]
        deltas.append(parser.extract_reasoning_streaming(previous, previous + piece, piece))
        previous += piece
    deltas.append(parser.finish_streaming())
    for delta in filter(None, deltas):
        assert delta and set(delta) <= set(out) and all(delta.values())
        for key, value in delta.items():
            out[key] += value
    return out["reasoning_content"] or None, out["content"] or None


def check_every_split(make, text: str):
    expected = make().extract_reasoning(text)
    assert replay(make(), text, list(range(1, len(text)))) == expected
    for cut in range(len(text) + 1):
        assert replay(make(), text, [cut]) == expected
    return expected


@pytest.mark.parametrize("text, expected", [
    ("<think>\nThe user greets me.\n</think>\n\nHello! 👋",
     ("\nThe user greets me.\n", "\n\nHello! 👋")),
    ("<think>\n\n</think>\n\nHello!", ("\n\n", "\n\nHello!")),
    ("Hello without thinking.", (None, "Hello without thinking.")),
    ("<think>\nstill thinking when max_tokens hit", ("\nstill thinking when max_tokens hit", None)),
    ("\n<think>x</think>y", ("x", "y")),
    ("<thinking>is not the tag</thinking>", (None, "<thinking>is not the tag</thinking>")),
    ("an answer that mentions </think> is an answer", (None,
                                                       "an answer that mentions </think> is an "
                                                       "answer")),
    ("<think>a</think>b</think>c", ("a", "b</think>c")),
    ("<thi", (None, "<thi")),
    ("", (None, None)),
])
def test_qwen3_without_a_prompt(text, expected):
    assert check_every_split(Qwen3ReasoningParser, text) == expected


def test_qwen3_prompt_that_opens_the_block():
    def make():
        return Qwen3ReasoningParser(prompt=HISTORY + QWEN3_PROMPT_THINKING)

    assert check_every_split(make, "Let me think.\n</think>\n\nHi!") == ("Let me think.\n",
                                                                          "\n\nHi!")
    assert check_every_split(make, "cut short") == ("cut short", None)


def test_qwen3_prompt_with_thinking_turned_off():
    def make():
        return Qwen3ReasoningParser(prompt=QWEN3_PROMPT_NO_THINKING)

    assert check_every_split(make, "Hi!</think>") == (None, "Hi!</think>")
    assert Qwen3ReasoningParser(prompt=HISTORY + "<|im_start|>assistant\n").extract_reasoning(
        "x</think>y") == (None, "x</think>y")


def test_deepseek_r1_reasons_until_the_end_tag():
    assert check_every_split(DeepSeekR1ReasoningParser, "Okay, 2+2.\n</think>\n\n4") == (
        "Okay, 2+2.\n", "\n\n4")
    assert check_every_split(DeepSeekR1ReasoningParser, "<think>\nhm</think>4") == ("\nhm", "4")
    assert check_every_split(DeepSeekR1ReasoningParser, "no end tag") == ("no end tag", None)
    closed = DeepSeekR1ReasoningParser(prompt="<｜Assistant｜><think>\n\n</think>\n\n")
    assert closed.extract_reasoning("4") == (None, "4")


def test_streaming_state_and_is_reasoning_end():
    parser = Qwen3ReasoningParser()
    assert parser.extract_reasoning_streaming("", "<think>", "<think>") is None
    assert parser.extract_reasoning_streaming("<think>", "<think>ab</th", "ab</th") == {
        "reasoning_content": "ab"}
    assert not parser.reasoning_ended
    assert parser.extract_reasoning_streaming("<think>ab</th", "<think>ab</think>c", "ink>c") == {
        "content": "c"}
    assert parser.reasoning_ended and parser.finish_streaming() is None
    assert parser.is_reasoning_end("<think>x</think>") and not parser.is_reasoning_end("<think>x")
    assert DeepSeekR1ReasoningParser().is_reasoning_end("x</think>")


def test_builtins_are_registered():
    assert {"qwen3", "deepseek_r1"} <= set(ReasoningParserRegistry.names())
    assert get_reasoning_parser("qwen3") is Qwen3ReasoningParser
    parser = make_reasoning_parser("deepseek_r1", prompt="x")
    assert isinstance(parser, DeepSeekR1ReasoningParser) and parser.prompt == "x"
    with pytest.raises(ValueError, match="qwen3"):
        get_reasoning_parser("nope")


_pieces = st.lists(st.sampled_from(["<think>", "</think>", "<th", "</th", "ink>", "<", "/", ">",
                                    "a", " ", "\n", "é", "🙂"]), max_size=20).map("".join)
_prompts = st.sampled_from([None, QWEN3_PROMPT_THINKING, QWEN3_PROMPT_NO_THINKING, HISTORY, ""])


@pytest.mark.parametrize("parser_cls", [Qwen3ReasoningParser, DeepSeekR1ReasoningParser])
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_streamed_equals_whole_for_every_split(parser_cls, data):
    text, prompt = data.draw(_pieces), data.draw(_prompts)
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=len(text) + 1))
    reasoning, content = parser_cls(prompt=prompt).extract_reasoning(text)
    assert replay(parser_cls(prompt=prompt), text, cuts) == (reasoning, content)
    # nothing is lost but the tags that delimit the reasoning
    assert len(reasoning or "") + len(content or "") <= len(text)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cuts=st.lists(st.integers(0, 200), max_size=40))
def test_reasoning_then_tool_calls_streamed_equals_whole(cuts):
    """The endpoint's pipeline for a Qwen3 model with both parsers: the reasoning parser's
    content deltas feed the tool parser."""
    from ember.tool_parsers.builtin import HermesToolParser

    text = ("<think>\nThe user wants the weather; call <tool_call> for Paris.\n</think>\n\n"
            'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            "</tool_call>")
    reasoning, content = Qwen3ReasoningParser().extract_reasoning(text)
    whole = HermesToolParser().extract_tool_calls(content)
    assert reasoning == "\nThe user wants the weather; call <tool_call> for Paris.\n"
    assert whole.content == "\n\nChecking.\n" and len(whole.tool_calls) == 1

    r_parser, t_parser = Qwen3ReasoningParser(), HermesToolParser()
    bounds = [0, *sorted({c for c in cuts if c < len(text)}), len(text)]
    got = {"reasoning": "", "content": "", "args": ""}
    fed = ""

    def tool_step(piece: str | None) -> None:
        nonlocal fed
        if piece is None:
            delta = t_parser.finish_streaming()
        else:
            delta = t_parser.extract_tool_calls_streaming(fed, fed + piece, piece)
            fed += piece
        for tc in (delta or {}).get("tool_calls", []):
            got["args"] += tc["function"]["arguments"]
        got["content"] += (delta or {}).get("content", "")

    previous = ""
    for a, b in zip(bounds, bounds[1:], strict=False):
        piece = text[a:b]
        delta = r_parser.extract_reasoning_streaming(previous, previous + piece, piece) or {}
        previous += piece
        got["reasoning"] += delta.get("reasoning_content", "")
        if "content" in delta:
            tool_step(delta["content"])
    tail = r_parser.finish_streaming() or {}
    got["reasoning"] += tail.get("reasoning_content", "")
    if "content" in tail:
        tool_step(tail["content"])
    tool_step(None)
    assert got == {"reasoning": reasoning, "content": whole.content,
                   "args": whole.tool_calls[0]["function"]["arguments"]}
