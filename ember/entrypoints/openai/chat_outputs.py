"""Chat's tool calls and reasoning: what a request's `tools` / `tool_choice` ask for, the
constraint that forces a call, and the parsers that split each choice's text into
`reasoning_content`, `content` and `tool_calls`, whole or streamed.

Modes, as vLLM: no tools or `tool_choice="none"` -> plain text; `"auto"` (the default with tools)
needs `--enable-auto-tool-choice --tool-call-parser NAME` and parses whatever the model writes;
`"required"` and a named function constrain the output with structured outputs to the JSON that
ember.tool_parsers.schema builds, so the calls always parse. With `--reasoning-parser NAME` the
reasoning is split off first and tools are looked for in the answer only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ember.entrypoints.openai.errors import OpenAIError


@dataclass
class ServerParsers:
    """`ember serve`'s parser settings (names checked at start-up)."""

    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    reasoning_parser: str | None = None

    def check(self) -> None:
        if self.enable_auto_tool_choice and not self.tool_call_parser:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser NAME")
        if self.tool_call_parser:
            from ember.tool_parsers import get_tool_parser

            get_tool_parser(self.tool_call_parser)
        if self.reasoning_parser:
            from ember.reasoning import get_reasoning_parser

            get_reasoning_parser(self.reasoning_parser)


def tool_mode(req: Any, parsers: ServerParsers) -> str:
    """"none", "auto", "required" or "named"; a 400 for what this server cannot do."""
    choice = req.tool_choice
    if not req.tools:
        if choice not in (None, "none"):
            raise OpenAIError("tool_choice needs tools", 400, param="tool_choice")
        if req.parallel_tool_calls is not None:
            raise OpenAIError("parallel_tool_calls needs tools", 400, param="parallel_tool_calls")
        return "none"
    from ember.tool_parsers.schema import validate_tools

    try:
        validate_tools(req.tools)
    except ValueError as exc:
        raise OpenAIError(str(exc), 400, param="tools") from None
    if req.parallel_tool_calls is False:
        raise OpenAIError("parallel_tool_calls=false is not supported: a response may hold "
                          "several calls", 400, param="parallel_tool_calls")
    if choice == "none":
        return "none"
    if choice in (None, "auto"):
        if not (parsers.enable_auto_tool_choice and parsers.tool_call_parser):
            raise OpenAIError('"auto" tool choice needs the server started with '
                              "--enable-auto-tool-choice and --tool-call-parser", 400,
                              param="tool_choice")
        return "auto"
    return "required" if choice == "required" else "named"


def tool_constraint(req: Any, mode: str) -> dict[str, Any] | None:
    """The JSON schema forcing a valid call for "required" / "named", else None."""
    if mode not in ("required", "named"):
        return None
    from ember.tool_parsers import tool_call_json_schema

    try:
        return tool_call_json_schema(req.tools, req.tool_choice)
    except (ValueError, KeyError, TypeError) as exc:
        raise OpenAIError(str(exc), 400, param="tool_choice") from None


def _tool_parser(req: Any, mode: str, parsers: ServerParsers, tokenizer: Any):
    from ember.tool_parsers import make_tool_parser
    from ember.tool_parsers.builtin import NamedToolCallParser, RequiredToolCallParser

    if mode == "auto":
        return make_tool_parser(parsers.tool_call_parser, tokenizer)
    if mode == "required":
        return RequiredToolCallParser(tokenizer)
    if mode == "named":
        return NamedToolCallParser(tokenizer, name=req.tool_choice["function"]["name"])
    return None


def needs_special_tokens(mode: str, parsers: ServerParsers) -> bool:
    """Whether the auto parser reads markers that are special tokens (decode keeps them)."""
    if mode != "auto":
        return False
    from ember.tool_parsers import get_tool_parser

    return bool(getattr(get_tool_parser(parsers.tool_call_parser), "needs_special_tokens", False))


class ChoiceParser:
    """One choice's text -> reasoning, content and tool calls (whole, or delta by delta)."""

    def __init__(self, req: Any, mode: str, parsers: ServerParsers, tokenizer: Any,
                 prompt_text: str | None) -> None:
        self.req, self.mode = req, mode
        self.tools = _tool_parser(req, mode, parsers, tokenizer)
        self.reasoning = None
        if parsers.reasoning_parser:
            from ember.reasoning import make_reasoning_parser

            self.reasoning = make_reasoning_parser(parsers.reasoning_parser, tokenizer,
                                                   prompt=prompt_text)
        self.answer = ""  # the content seen by the tool parser so far

    @property
    def active(self) -> bool:
        return self.tools is not None or self.reasoning is not None

    def whole(self, text: str) -> tuple[str | None, str | None, list[dict] | None]:
        """(reasoning_content, content, tool_calls) of a finished choice."""
        reasoning, content = None, text
        if self.reasoning is not None:
            reasoning, content = self.reasoning.extract_reasoning(text)
        if self.tools is None:
            return reasoning, content, None
        extracted = self.tools.extract_tool_calls(content or "", self.req.tools)
        if not extracted.tools_called:
            return reasoning, extracted.content, None
        return reasoning, extracted.content, extracted.tool_calls

    def delta(self, previous: str, current: str, delta: str) -> dict[str, Any]:
        """The delta fields (reasoning_content, content, tool_calls) for `delta`."""
        out: dict[str, Any] = {}
        content = delta
        if self.reasoning is not None:
            split = self.reasoning.extract_reasoning_streaming(previous, current, delta) or {}
            if split.get("reasoning_content"):
                out["reasoning_content"] = split["reasoning_content"]
            content = split.get("content") or ""
        self._content(content, out)
        return out

    def finish(self) -> dict[str, Any]:
        """What the parsers held back, now that the choice has ended."""
        out: dict[str, Any] = {}
        content = ""
        if self.reasoning is not None:
            split = self.reasoning.finish_streaming() or {}
            if split.get("reasoning_content"):
                out["reasoning_content"] = split["reasoning_content"]
            content = split.get("content") or ""
        self._content(content, out)
        if self.tools is not None:
            _merge(out, self.tools.finish_streaming() or {})
        return out

    @property
    def tools_called(self) -> bool:
        return self.tools is not None and self.tools.tools_called

    def _content(self, content: str, out: dict[str, Any]) -> None:
        if not content:
            return
        if self.tools is None:
            out["content"] = out.get("content", "") + content
            return
        previous = self.answer
        self.answer += content
        _merge(out, self.tools.extract_tool_calls_streaming(previous, self.answer, content) or {})


def _merge(out: dict[str, Any], extra: dict[str, Any]) -> None:
    if extra.get("content"):
        out["content"] = out.get("content", "") + extra["content"]
    if extra.get("tool_calls"):
        out.setdefault("tool_calls", []).extend(extra["tool_calls"])
