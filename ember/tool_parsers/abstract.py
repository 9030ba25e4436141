"""The tool-call parser contract: `ToolParser` (what the chat endpoint calls) and its result types.

A parser instance serves ONE response: the non-streaming call is stateless, but streaming keeps
per-response state, so make a new parser for each streamed choice. Calls come out as plain dicts
in OpenAI's shape, ready for a response body:

    {"id": "chatcmpl-tool-…", "type": "function",
     "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}

and streamed as OpenAI's deltas: the first delta of call i is
``{"index": i, "id": …, "type": "function", "function": {"name": …, "arguments": "…"}}``, later
ones ``{"index": i, "function": {"arguments": "…"}}``; concatenating a call's argument pieces gives
its full `arguments`. Concatenated content deltas, and argument pieces, equal the non-streaming
result for every split of the output into deltas (`finish_streaming` returns what was held back
at the end), as long as no call turns out malformed after its name was streamed (which cannot
be taken back; `ExtractedToolCalls` then reports the whole output as content, as vLLM does).
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ember.tool_parsers.scanner import CallFormat, CallScanner, ScanState


def make_tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass
class ExtractedToolCalls:
    """A whole response: its calls (OpenAI dicts) and the text outside them (None if empty)."""

    tools_called: bool
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    content: str | None = None


def tool_call(name: str, arguments: str, call_id: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function",
            "function": {"name": name, "arguments": arguments}}


class ToolParser:
    """Base class of tool-call parsers (registered in ember.registry.ToolParserRegistry).

    Subclasses of the built-in kind only set `call_format` (see ember.tool_parsers.scanner); a
    third-party parser may instead override `extract_tool_calls` and
    `extract_tool_calls_streaming` (and `finish_streaming`) with its own logic.
    """

    call_format: ClassVar[CallFormat]
    # The markers of some formats are special tokens: the endpoint must decode with
    # skip_special_tokens=False for this parser to see them (vLLM's adjust_request for mistral).
    needs_special_tokens: ClassVar[bool] = False

    def __init__(self, tokenizer: Any = None) -> None:
        self.tokenizer = tokenizer  # unused by the built-ins (they parse text); vLLM's signature
        self._scanner: CallScanner | None = None
        self._sent_content = 0
        self._sent_args: list[int] = []   # per announced call: argument characters sent
        self._ids: list[str] = []

    def make_id(self) -> str:
        return make_tool_call_id()

    # ------------------------------------------------------------------ whole output

    def extract_tool_calls(self, model_output: str,
                           tools: Sequence[Any] | None = None) -> ExtractedToolCalls:
        """The calls in a complete output. `tools` (the request's) is accepted for parsers that
        want it; the built-ins do not check names against it (vLLM does not either)."""
        scanner = CallScanner(self.call_format)
        scanner.feed(model_output)
        scanner.finish()
        state = scanner.state
        if state.malformed or not state.calls or state.fallback:
            return ExtractedToolCalls(False, [], model_output or None)
        calls = [tool_call(c.name or "", model_output[c.args_start:c.args_end], self.make_id())
                 for c in state.calls]
        return ExtractedToolCalls(True, calls, "".join(state.content) or None)

    # ------------------------------------------------------------------ streaming

    def extract_tool_calls_streaming(self, previous_text: str, current_text: str,
                                     delta_text: str, *args: Any,
                                     **kwargs: Any) -> dict[str, Any] | None:
        """One step of a stream: a DeltaMessage-like dict (keys "content" and/or "tool_calls")
        or None when nothing is ready to send. `current_text` is `previous_text + delta_text`
        (vLLM's signature; extra vLLM arguments such as token ids are accepted and ignored)."""
        if self._scanner is None:
            self._scanner = CallScanner(self.call_format)
            if previous_text:  # started mid-stream: the past is decided without output
                self._scanner.feed(previous_text)
                self._collect()
        self._scanner.feed(delta_text)
        return self._collect()

    def finish_streaming(self) -> dict[str, Any] | None:
        """The last delta of a stream, after the final `extract_tool_calls_streaming`: text
        held back because it might have begun a call, now known to be content."""
        if self._scanner is None:
            return None
        self._scanner.finish()
        return self._collect()

    @property
    def tools_called(self) -> bool:
        """Whether this stream has sent a tool call (finish_reason "tool_calls")."""
        return bool(self._ids)

    def _collect(self) -> dict[str, Any] | None:
        assert self._scanner is not None
        state: ScanState = self._scanner.state
        text, delta = self._scanner.text, {}
        content = "".join(state.content[self._sent_content:])
        self._sent_content = len(state.content)
        if content:
            delta["content"] = content
        calls = []
        for index, call in enumerate(state.calls):
            if not call.committed or call.args_start is None or (
                    state.malformed and call.args_end is None):
                continue
            end = call.args_end if call.args_end is not None else self._scanner.pos
            if index == len(self._ids):
                self._ids.append(self.make_id())
                self._sent_args.append(end - call.args_start)
                calls.append({"index": index, "id": self._ids[index], "type": "function",
                              "function": {"name": call.name,
                                           "arguments": text[call.args_start:end]}})
            elif end - call.args_start > self._sent_args[index]:  # slice only what is new
                calls.append({"index": index, "function": {
                    "arguments": text[call.args_start + self._sent_args[index]:end]}})
                self._sent_args[index] = end - call.args_start
        if calls:
            delta["tool_calls"] = calls
        return delta or None
