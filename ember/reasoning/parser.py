"""The reasoning-parser contract (`ReasoningParser`) and the tag-delimited implementation the
built-ins share (`ThinkTagReasoningParser`).

A parser instance serves ONE response. `extract_reasoning(output)` gives ``(reasoning_content,
content)``, each None when empty. Streaming, `extract_reasoning_streaming(previous_text,
current_text, delta_text)` returns ``{"reasoning_content": …}`` and/or ``{"content": …}`` (or None
while text is held back because it might be the start of a tag), and `finish_streaming()` the
text still held at the end. Concatenated deltas equal the non-streaming result for every split of
the output into deltas: both run the same scanner, which decides character by character.

Where the reasoning starts: a response whose output begins with the start tag (leading
whitespace allowed) reasons until the end tag. Otherwise it depends on the prompt: chat
templates such as Qwen3's thinking variants and DeepSeek-R1's put the start tag in the prompt,
so the output opens inside the reasoning block. Give the rendered prompt (``prompt=``) and the
parser sees that; without it, the class default `starts_in_reasoning` applies. Reasoning without
an end tag (the output was cut short) is all reasoning.
"""

from __future__ import annotations

from typing import Any, ClassVar

_WS = " \t\r\n"


class ReasoningParser:
    """Base class of reasoning parsers (registered in ember.registry.ReasoningParserRegistry)."""

    def __init__(self, tokenizer: Any = None, *, prompt: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.prompt = prompt

    def extract_reasoning(self, model_output: str) -> tuple[str | None, str | None]:
        raise NotImplementedError

    def extract_reasoning_streaming(self, previous_text: str, current_text: str,
                                    delta_text: str, *args: Any,
                                    **kwargs: Any) -> dict[str, str] | None:
        raise NotImplementedError

    def finish_streaming(self) -> dict[str, str] | None:
        return None

    def tag_token_ids(self) -> tuple[int, int] | None:
        """(start, end) token ids of the reasoning tags in this parser's tokenizer, where each tag
        is one token (the engine core finds where an answer starts by them, so that structured
        outputs constrain the answer only); None when the parser has no such tags."""
        return None

    def is_reasoning_end(self, model_output: str) -> bool:
        """Whether the output so far has left the reasoning (an answer constrained by structured
        outputs starts after this point)."""
        raise NotImplementedError


class _Scanner:
    """Splits text fed in pieces into reasoning and content."""

    def __init__(self, start: str, end: str, in_reasoning: bool) -> None:
        self.start_tag, self.end_tag = start, end
        self.default = "reasoning" if in_reasoning else "content"
        self.text = ""
        self.pos = 0
        self.mode = "start"  # start | reasoning | content
        self.out: dict[str, list[str]] = {"reasoning_content": [], "content": []}

    def feed(self, delta: str, final: bool = False) -> None:
        self.text += delta
        if self.mode == "start":
            rest = self.text.lstrip(_WS)
            if rest.startswith(self.start_tag):
                self.pos = len(self.text) - len(rest) + len(self.start_tag)
                self.mode = "reasoning"
            elif final or (rest and not self.start_tag.startswith(rest)):
                self.mode = self.default
            else:
                return
        if self.mode == "reasoning":
            at = self.text.find(self.end_tag, self.pos)
            if at < 0:
                end = len(self.text) if final else len(self.text) - _partial_suffix(
                    self.text, self.end_tag, self.pos)
                self._put("reasoning_content", end)
                return
            self._put("reasoning_content", at)
            self.pos = at + len(self.end_tag)
            self.mode = "content"
        self._put("content", len(self.text))

    def _put(self, key: str, end: int) -> None:
        if end > self.pos:
            self.out[key].append(self.text[self.pos:end])
            self.pos = end


def _partial_suffix(text: str, tag: str, start: int) -> int:
    for k in range(min(len(tag) - 1, len(text) - start), 0, -1):
        if tag.startswith(text[len(text) - k:]):
            return k
    return 0


class ThinkTagReasoningParser(ReasoningParser):
    """Reasoning between `start_token` and `end_token`; the rest is the answer."""

    start_token: ClassVar[str] = "<think>"
    end_token: ClassVar[str] = "</think>"
    # Without a prompt to look at: does an output that does not begin with the start tag begin
    # inside the reasoning block?
    starts_in_reasoning: ClassVar[bool] = False

    def __init__(self, tokenizer: Any = None, *, prompt: str | None = None) -> None:
        super().__init__(tokenizer, prompt=prompt)
        self._stream: _Scanner | None = None
        self._sent = {"reasoning_content": 0, "content": 0}

    def opens_in_reasoning(self) -> bool:
        """Whether an output that does not begin with the start tag is reasoning: the prompt
        left a reasoning block open (its last start tag comes after its last end tag), or it
        closed one (thinking turned off: an answer follows), or else the class default."""
        if self.prompt is not None:
            opened, closed = self.prompt.rfind(self.start_token), self.prompt.rfind(self.end_token)
            if opened > closed:
                return True
            if closed >= 0 and not self.prompt[closed + len(self.end_token):].strip(_WS):
                return False
        return self.starts_in_reasoning

    def tag_token_ids(self) -> tuple[int, int] | None:
        ids = []
        for tag in (self.start_token, self.end_token):
            encoded = self.tokenizer.encode(tag, add_special_tokens=False)
            if len(encoded) != 1:
                return None
            ids.append(encoded[0])
        return ids[0], ids[1]

    def _scanner(self) -> _Scanner:
        return _Scanner(self.start_token, self.end_token, self.opens_in_reasoning())

    def extract_reasoning(self, model_output: str) -> tuple[str | None, str | None]:
        scanner = self._scanner()
        scanner.feed(model_output, final=True)
        return ("".join(scanner.out["reasoning_content"]) or None,
                "".join(scanner.out["content"]) or None)

    def extract_reasoning_streaming(self, previous_text: str, current_text: str,
                                    delta_text: str, *args: Any,
                                    **kwargs: Any) -> dict[str, str] | None:
        if self._stream is None:
            self._stream = self._scanner()
            if previous_text:  # started mid-stream: the past is decided without output
                self._stream.feed(previous_text)
                self._collect()
        self._stream.feed(delta_text)
        return self._collect()

    def finish_streaming(self) -> dict[str, str] | None:
        if self._stream is None:
            return None
        self._stream.feed("", final=True)
        return self._collect()

    @property
    def reasoning_ended(self) -> bool:
        """Streaming: whether the answer has begun."""
        return self._stream is not None and self._stream.mode == "content"

    def is_reasoning_end(self, model_output: str) -> bool:
        scanner = self._scanner()
        scanner.feed(model_output)
        return scanner.mode == "content"

    def _collect(self) -> dict[str, str] | None:
        assert self._stream is not None
        delta = {}
        for key, parts in self._stream.out.items():
            text = "".join(parts[self._sent[key]:])
            self._sent[key] = len(parts)
            if text:
                delta[key] = text
        return delta or None
