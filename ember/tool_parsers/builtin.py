"""The built-in tool-call parsers (vLLM's names): hermes, llama3_json, mistral.

Each is a `CallFormat` (ember.tool_parsers.scanner); parsing, streaming included, is shared.
Where ember departs from vLLM, on purpose:
- Arguments are the JSON text the model wrote (vLLM re-serialises them with json.dumps): a
  streamed call then concatenates to exactly the non-streamed one.
- Content is all text outside calls, not only the text before the first one; whitespace right
  after a group of calls is dropped.
- llama3_json finds calls only at the start of the output (as vLLM's streaming parser does; its
  non-streaming one searches the whole text, so the two could disagree).
"""

from __future__ import annotations

import random
import string
from typing import Any

from ember.tool_parsers.abstract import ExtractedToolCalls, ToolParser, tool_call
from ember.tool_parsers.scanner import CallFormat


class HermesToolParser(ToolParser):
    """Qwen2.5 / Qwen3 / Hermes 2 Pro: ``<tool_call>\\n{"name": …, "arguments": {…}}\\n</tool_call>``,
    any number of them, with text before, between or after."""

    call_format = CallFormat(marker="<tool_call>", close="</tool_call>")


class Llama3JsonToolParser(ToolParser):
    """Llama 3.x JSON tool calling: the output is ``{"name": …, "parameters": {…}}`` (or
    "arguments"), optionally after ``<|python_tag|>``, several separated by ``;``."""

    call_format = CallFormat(at_start=("<|python_tag|>",), starts_with="{", sep=";")


_ALNUM = string.ascii_letters + string.digits


class MistralToolParser(ToolParser):
    """Mistral: ``[TOOL_CALLS][{"name": …, "arguments": {…}}, …]`` (tokenizers before v11), and
    ``[TOOL_CALLS]name{…}`` / ``[TOOL_CALLS]name[ARGS]{…}`` (v11 / v13), one call per marker.

    `[TOOL_CALLS]` is a special token: decode with skip_special_tokens=False."""

    call_format = CallFormat(marker="[TOOL_CALLS]", open="[", sep=",", close="]",
                             named_args=("[ARGS]", "{"))
    needs_special_tokens = True

    def make_id(self) -> str:
        # mistral_common accepts only 9 alphanumeric characters as a tool call id.
        return "".join(random.choices(_ALNUM, k=9))


class RequiredToolCallParser(ToolParser):
    """Not registered: parses what `tool_choice="required"` constrains the output to
    (ember.tool_parsers.schema.required_tool_calls_schema): ``[{"name": …, "parameters": {…}}]``."""

    call_format = CallFormat(starts_with="[", open="[", sep=",", close="]",
                             arg_keys=("parameters",), repeat=False)


class NamedToolCallParser(ToolParser):
    """Not registered: the output of a request whose tool_choice names a function is that
    function's arguments object (constrained by ember.tool_parsers.schema.named_tool_call_schema).
    Whitespace around the object is dropped; streaming sends the id and name with the first
    piece of the arguments."""

    def __init__(self, tokenizer: Any = None, *, name: str) -> None:
        super().__init__(tokenizer)
        self.name = name
        self._text = ""
        self._sent = 0

    def extract_tool_calls(self, model_output: str, tools: Any = None) -> ExtractedToolCalls:
        return ExtractedToolCalls(True, [tool_call(self.name, model_output.strip(),
                                                   self.make_id())], None)

    def extract_tool_calls_streaming(self, previous_text: str, current_text: str,
                                     delta_text: str, *args: Any,
                                     **kwargs: Any) -> dict[str, Any] | None:
        self._text += delta_text
        return self._send(len(self._text.rstrip()))  # trailing whitespace waits

    def finish_streaming(self) -> dict[str, Any] | None:
        return None

    def _send(self, end: int) -> dict[str, Any] | None:
        start = self._sent if self._ids else len(self._text) - len(self._text.lstrip())
        if end <= start:
            return None
        self._sent = end
        piece = self._text[start:end]
        if self._ids:
            return {"tool_calls": [{"index": 0, "function": {"arguments": piece}}]}
        self._ids.append(self.make_id())
        return {"tool_calls": [{"index": 0, "id": self._ids[0], "type": "function",
                                "function": {"name": self.name, "arguments": piece}}]}
