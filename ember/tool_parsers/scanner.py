"""An incremental scanner of model output into text and tool calls, shared by every built-in
tool-call parser.

Streaming and non-streaming parsing are one code path: `CallScanner` consumes text in pieces of
any size and records what it has decided (content text, calls with their name and the raw text of
their arguments); the non-streaming result is the scanner run over the whole output. Everything is
decided character by character (or by `str.find` over text the scanner has already seen), so the
decisions do not depend on how the text was split into deltas.

A format (`CallFormat`) says where calls start (a marker anywhere in the text, like hermes's
`<tool_call>`, or only at the very start of the output, like llama3's bare JSON), what opens and
closes a group of calls, and what separates calls in a group. A call is one JSON object with a
string "name" and an object under one of the argument keys; its arguments are passed on as the
model wrote them (a substring of the output, valid JSON once the object is).

A call is *committed* (its id and name can be streamed) once its name is known and its arguments
object has begun. Text that might still be part of a call is held back. What goes wrong before a
commit turns the held text back into content; what goes wrong after one marks the output
`malformed` (a streamed call cannot be taken back).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

_WS = " \t\r\n"


class Malformed(ValueError):
    """The text is not a call in the format (raised inside the scanner only)."""


@dataclass(frozen=True)
class CallFormat:
    marker: str = ""             # opens a group of calls anywhere in content ("" : no marker)
    at_start: tuple[str, ...] = ()  # or: prefixes that open a group at the start of the output
    starts_with: str = ""        # or: a group at the start begins with this (not consumed)
    open: str = ""               # after the marker/prefix: "[" for an array of calls
    sep: str = ""                # between calls of one group ("," or ";"), "" for one per group
    close: str = ""              # ends a group ("</tool_call>", "]"); "" : the group ends with
                                 # the first text that is no separator (that text is content)
    arg_keys: tuple[str, ...] = ("arguments", "parameters")
    repeat: bool = True          # after a group, look for the marker again (else: all content)
    # A group may instead be one call written `name{arguments}` or `name[ARGS]{arguments}`
    # (Mistral's tokenizers from v11); `open` tells the two apart.
    named_args: tuple[str, ...] = ()


@dataclass
class Call:
    name: str | None = None
    args_start: int | None = None   # index of the arguments object's "{" in the output
    args_end: int | None = None     # index after its "}"
    committed: bool = False


class _ObjectScanner:
    """One call object, from its "{" to the matching "}", scanned as text arrives."""

    def __init__(self, start: int, arg_keys: tuple[str, ...], name: str | None = None) -> None:
        self.start = self.pos = start
        self.arg_keys = arg_keys
        self.bare = name is not None  # the object is the arguments of a call named before it
        self.stack: list[str] = []
        self.in_str = self.esc = False
        self.str_start = 0
        self.expect = "open"  # open | key | colon | value | scalar | after
        self.key: str | None = None
        self.keys: set[str] = set()
        self.value_key: str | None = None  # the top-level key whose nested value is open
        self.call = Call(name=name)
        self.end: int | None = None

    def advance(self, text: str) -> None:
        i, n = self.pos, len(text)
        while i < n and self.end is None:
            c = text[i]
            if self.in_str:
                if self.esc:
                    self.esc = False
                elif c == "\\":
                    self.esc = True
                elif c == '"':
                    self.in_str = False
                    if len(self.stack) == 1:
                        self._top_string(text[self.str_start:i + 1])
                i += 1
                continue
            if c in _WS:
                i += 1
                continue
            if not self.stack:
                if c != "{":
                    raise Malformed("a call is a JSON object")
                if self.bare:
                    self.call.args_start = i
                self.stack.append("}")
                self.expect = "key"
            elif len(self.stack) == 1:
                self._top(c, i)
            else:
                self._nested(c, i)
            i += 1
        self.pos = i

    def _top_string(self, token: str) -> None:
        try:
            value = json.loads(token)
        except json.JSONDecodeError as exc:  # a raw control character, a bad escape
            raise Malformed(f"a bad JSON string: {exc}") from None
        if self.expect == "key":
            if value in self.keys:
                raise Malformed(f"key {value!r} given twice")
            self.key = value
            self.keys.add(value)
            self.expect = "colon"
        else:  # a string value of a top-level key
            if self.key == "name" and not self.bare:
                if not value:
                    raise Malformed("an empty name")
                self.call.name = value
            self.expect = "after"

    def _top(self, c: str, i: int) -> None:
        if self.expect == "key":
            if c == '"':
                self.in_str, self.str_start = True, i
            elif c == "}" and not self.keys:
                self._close(i)
            else:
                raise Malformed(f"expected a key, got {c!r}")
        elif self.expect == "colon":
            if c != ":":
                raise Malformed(f"expected ':', got {c!r}")
            self.expect = "value"
        elif self.expect == "value":
            if self.bare:
                pass
            elif self.key == "name" and c != '"':
                raise Malformed("the name is not a string")
            elif self.key in self.arg_keys:
                if c != "{":
                    raise Malformed("the arguments are not a JSON object")
                if self.call.args_start is not None:
                    raise Malformed("arguments given twice")
                self.call.args_start = i
            if c == '"':
                self.in_str, self.str_start = True, i
            elif c in "{[":
                self.stack.append("}" if c == "{" else "]")
                self.value_key = self.key
            else:
                self.expect = "scalar"
        elif c == ",":
            self.expect = "key"
        elif c == "}":
            self._close(i)
        elif self.expect != "scalar":
            raise Malformed(f"expected ',' or '}}', got {c!r}")

    def _nested(self, c: str, i: int) -> None:
        if c == '"':
            self.in_str, self.str_start = True, i
        elif c in "{[":
            self.stack.append("}" if c == "{" else "]")
        elif c in "}]":
            if c != self.stack.pop():
                raise Malformed(f"unbalanced {c!r}")
            if len(self.stack) == 1:
                if self.value_key in self.arg_keys:
                    self.call.args_end = i + 1
                self.expect = "after"

    def _close(self, i: int) -> None:
        self.stack.pop()
        self.end = i + 1
        if self.bare:
            self.call.args_end = self.end


@dataclass
class ScanState:
    """What the scanner has decided so far (read by the streaming driver)."""

    content: list[str] = field(default_factory=list)
    calls: list[Call] = field(default_factory=list)
    malformed: bool = False   # a call went wrong after one was committed
    fallback: bool = False    # a call went wrong before any commit: all text is content


class CallScanner:
    """Feed text with `feed`, then `finish()` once; `state` holds the decisions."""

    def __init__(self, fmt: CallFormat) -> None:
        self.fmt = fmt
        self.text = ""
        self.pos = 0            # everything before is decided
        self.held = 0           # start of the text held back (not content, not a committed call)
        self.mode = "start" if fmt.at_start or fmt.starts_with else "content"
        self.after_call = False  # drop whitespace before content that follows a group
        self.obj: _ObjectScanner | None = None
        self.group_named = False
        self.state = ScanState()

    # ----------------------------------------------------------------- driving

    def feed(self, delta: str) -> None:
        self.text += delta
        try:
            self._run(final=False)
        except Malformed:
            self._fail()

    def finish(self) -> None:
        try:
            self._run(final=True)
            if self.mode in ("object", "open", "next", "name"):
                raise Malformed("the output ends inside a call")
        except Malformed:
            self._fail()
        self._run(final=True)  # flush content held back in "content"/"tail"/"plain"

    @property
    def committed(self) -> int:
        return sum(c.committed for c in self.state.calls)

    def _emit(self, text: str) -> None:
        if self.after_call:
            stripped = text.lstrip(_WS)
            if not stripped:
                return
            text, self.after_call = stripped, False
        if text:
            self.state.content.append(text)

    def _fail(self) -> None:
        """The call being read is no call: its held text is content from here on."""
        if self.committed:
            self.state.malformed = True
            start = self.pos if self.obj is not None and self.obj.call.committed else self.held
        else:
            self.state.fallback = True
            start = self.held
        self.after_call = False
        self._emit(self.text[start:])
        self.pos = len(self.text)
        self.obj = None
        self.mode = "plain"

    def _run(self, final: bool) -> None:
        while True:
            before = (self.mode, self.pos)
            getattr(self, "_" + self.mode)(final)
            if (self.mode, self.pos) == before:
                return

    # ----------------------------------------------------------------- modes

    def _plain(self, final: bool) -> None:
        self._emit(self.text[self.pos:])
        self.pos = len(self.text)

    _tail = _plain  # content after a group of calls that has no close (with after_call set)

    def _start(self, final: bool) -> None:
        """At the very start of the output: does a group of calls begin here?"""
        rest = self.text[self.pos:].lstrip(_WS)
        for prefix in self.fmt.at_start:
            if rest.startswith(prefix):
                self.pos = len(self.text) - len(rest) + len(prefix)
                self.mode = "open"
                return
        if self.fmt.starts_with and rest.startswith(self.fmt.starts_with):
            self.pos = len(self.text) - len(rest)
            self.mode = "open"
        elif rest and not any(p.startswith(rest) for p in self.fmt.at_start):
            self.mode = "content" if self.fmt.marker else "plain"
        elif final and self.pos < len(self.text):
            self.mode = "plain"  # only whitespace, or the start of a prefix: that is content

    def _content(self, final: bool) -> None:
        marker = self.fmt.marker
        if not marker:
            self.mode = "plain"
            return
        at = self.text.find(marker, self.pos)
        if at >= 0:
            self._emit(self.text[self.pos:at])
            self.pos = self.held = at
            self.pos += len(marker)
            self.mode = "open"
            return
        end = len(self.text) if final else len(self.text) - _partial_suffix(self.text, marker,
                                                                            self.pos)
        self._emit(self.text[self.pos:end])
        self.pos = end

    def _skip_ws(self) -> str | None:
        while self.pos < len(self.text) and self.text[self.pos] in _WS:
            self.pos += 1
        return self.text[self.pos] if self.pos < len(self.text) else None

    def _open(self, final: bool) -> None:
        if self.fmt.open:
            c = self._skip_ws()
            if c is None:
                return
            if c != self.fmt.open:
                if self.fmt.named_args:
                    self.mode = "name"
                    return
                raise Malformed(f"expected {self.fmt.open!r}")
            self.pos += 1
        self.group_named = False
        self.mode = "next"

    def _name(self, final: bool) -> None:
        """A call written `name{…}` / `name[ARGS]{…}`: the name, up to its arguments."""
        text, start = self.text, self.pos
        i = start
        while i < len(text) and (text[i].isalnum() or text[i] in "_-"):
            i += 1
        rest = text[i:]
        for sep in self.fmt.named_args:
            if rest.startswith(sep) and i > start:
                self.group_named = True
                self.pos = i + len(sep) - (sep == "{")  # "{" is the object's own
                self.obj = _ObjectScanner(self.pos, (), name=text[start:i])
                self.state.calls.append(self.obj.call)
                self.mode = "object"
                return
        if i == len(text) or (any(sep.startswith(rest) for sep in self.fmt.named_args)
                              and not final):
            return  # the name, or what follows it, is still arriving
        raise Malformed("expected a call name and its arguments")

    def _next(self, final: bool) -> None:
        """Before a call object."""
        c = self._skip_ws()
        if c is None:
            return
        if self.fmt.open and c == self.fmt.close and not self.state.calls:
            raise Malformed("an empty list of calls")
        self.obj = _ObjectScanner(self.pos, self.fmt.arg_keys)
        self.state.calls.append(self.obj.call)
        self.mode = "object"

    def _object(self, final: bool) -> None:
        obj = self.obj
        assert obj is not None
        obj.advance(self.text)
        self.pos = obj.pos
        call = obj.call
        if not call.committed and call.name is not None and call.args_start is not None:
            call.committed = True
        if obj.end is None:
            return
        if not call.committed:
            raise Malformed("a call needs a string 'name' and an object of arguments")
        _validate(self.text[obj.start:obj.end], () if obj.bare else self.fmt.arg_keys)
        self.obj = None
        self.mode = "after"

    def _after(self, final: bool) -> None:
        """After a call object: a separator, the group's close, or (no close) content."""
        fmt = self.fmt
        if self.group_named:  # one call per group; what follows is content or another group
            self._end_group()
            return
        c = self._skip_ws()
        if c is None:
            return
        rest = self.text[self.pos:]
        if fmt.sep and rest.startswith(fmt.sep):
            self.pos += len(fmt.sep)
            self.mode = "next"
        elif fmt.close and rest.startswith(fmt.close):
            self.pos += len(fmt.close)
            self._end_group()
        elif fmt.close and fmt.close.startswith(rest) and not final:
            return  # a close tag still arriving
        elif not fmt.close:
            self._end_group()
        else:
            raise Malformed(f"expected {fmt.close!r} after a call")

    def _end_group(self) -> None:
        self.held = self.pos
        self.after_call = True
        self.mode = "content" if self.fmt.repeat and self.fmt.marker else "tail"


def _partial_suffix(text: str, marker: str, start: int) -> int:
    """The length of the longest end of text[start:] that begins `marker` (held back)."""
    for k in range(min(len(marker) - 1, len(text) - start), 0, -1):
        if marker.startswith(text[len(text) - k:]):
            return k
    return 0


def _validate(obj_text: str, arg_keys: tuple[str, ...]) -> None:
    try:
        obj = json.loads(obj_text)
    except json.JSONDecodeError as exc:
        raise Malformed(f"a call is not valid JSON: {exc}") from None
    if not arg_keys:  # the arguments object of a call named outside it
        return
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        raise Malformed("a call needs a string 'name'")
    if sum(k in obj for k in arg_keys) != 1:
        raise Malformed(f"a call needs exactly one of {arg_keys}")
