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

from ember.tool_parsers.abstract import ToolParser
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
    """Mistral (tokenizer before v11): ``[TOOL_CALLS][{"name": …, "arguments": {…}}, …]``.

    `[TOOL_CALLS]` is a special token: decode with skip_special_tokens=False."""

    call_format = CallFormat(marker="[TOOL_CALLS]", open="[", sep=",", close="]")
    needs_special_tokens = True

    def make_id(self) -> str:
        # mistral_common accepts only 9 alphanumeric characters as a tool call id.
        return "".join(random.choices(_ALNUM, k=9))


class RequiredToolCallParser(ToolParser):
    """Not registered: parses what `tool_choice="required"` constrains the output to
    (ember.tool_parsers.schema.required_tool_calls_schema): ``[{"name": …, "parameters": {…}}]``."""

    call_format = CallFormat(starts_with="[", open="[", sep=",", close="]",
                             arg_keys=("parameters",), repeat=False)
