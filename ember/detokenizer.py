"""Incremental detokenization of one sequence: token ids in, text deltas out, stop strings cut.

Decoding each new token on its own is wrong twice over: a multi-byte character split across
tokens comes out as U+FFFD, and sentencepiece-style tokenizers drop the leading space of the first
token they decode. So, as vLLM does, we decode a short window of tokens: ids from `prefix_offset`
to `read_offset` are text already emitted (kept as context), ids from `read_offset` on are new; the
delta is whatever the window decodes to beyond its prefix, held while it ends in U+FFFD (an
unfinished character).

Stop strings: after each token only the new text plus the `max_stop_len - 1` characters before it
are searched (an earlier match would have been found earlier), and `.text` is cut at the first
match, without or with the stop string (`include_stop_str_in_output`).

Streaming with stop strings: a stop string may begin in text already decoded and complete in a
later token, and emitted text cannot be taken back. `output_text_delta()` therefore holds back the
last `max_stop_len - 1` characters until they can no longer start a stop string (more text came,
a stop matched, or `finish()` was called). Its results concatenate to exactly the final `.text`.

Fast tokenizers (a `tokenizers` backend, no transformers clean-up of the decoded text) decode
through `tokenizers`' DecodeStream, which runs the same window in native code: one call a token,
where the window's two `tokenizer.decode` calls cost ~6 us of Python a token (the front end's
largest cost in host-bound runs). The window above stays for flushing an unfinished character,
for `spaces_between_special_tokens` with special tokens kept, and for other tokenizers.

Typical use by the engine, once per step:
    detok.append(new_ids)                 # returns the raw new text (not held back)
    if detok.stop_string_hit is not None: finish the request (reason "stop")
    elif the request ended otherwise: detok.finish()   # flush an unfinished trailing char
    stream(detok.output_text_delta())
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# Prompt tokens kept as decoding context, so the first generated token keeps its leading space.
PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Streams the text of one generated sequence; see the module docstring for the protocol.

    Attributes: `token_ids` (generated ids appended so far, up to the one that completed a stop
    string), `text` (decoded text so far, cut at a stop string), `stop_string_hit` (the stop
    string that matched, or None), `finished` (a stop string matched or `finish()` was called).
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: Sequence[int] | None = None,
        *,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        stop: Iterable[str] | None = None,
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # Only meaningful when special tokens are kept: vLLM's (slow-tokenizer) rule of one space
        # between a special token and its neighbours.
        self._spaced = spaces_between_special_tokens and not skip_special_tokens
        self._special_ids = _special_ids(tokenizer) if self._spaced else frozenset()
        self.stop = [s for s in (stop or ()) if s]
        self.include_stop_str_in_output = include_stop_str_in_output
        # vLLM's rule: a stop string completed by one of the first min_tokens tokens is ignored
        # (only text added once more than min_tokens tokens exist is searched).
        self.min_tokens = min_tokens
        self._hold = max((len(s) for s in self.stop), default=1) - 1

        context = list(prompt_token_ids or ())[-PROMPT_CONTEXT_TOKENS:]
        self._ids: list[int] = context  # decoding context + generated ids
        self._prefix_offset = 0
        self._read_offset = len(context)
        self.token_ids: list[int] = []
        self.text = ""
        self.stop_string_hit: str | None = None
        self.finished = False
        self._output_offset = 0  # how much of .text output_text_delta() has handed out
        # DecodeStream (module docstring), primed with the context so that the first generated
        # token decodes as it would after it; None where the window decodes instead.
        self._stream = None if self._spaced else _decode_stream(tokenizer, skip_special_tokens)
        if self._stream is not None and not self._prime(context):
            self._stream = None

    # -- decoding -----------------------------------------------------------------------------

    def _decode(self, ids: list[int]) -> str:
        if not self._spaced or not self._special_ids.intersection(ids):
            return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)
        # Split at special tokens, decode the runs between them, join everything with spaces.
        parts: list[str] = []
        run: list[int] = []
        for i in ids:
            if i in self._special_ids:
                if run:
                    parts.append(self.tokenizer.decode(run, skip_special_tokens=False))
                    run = []
                parts.append(self.tokenizer.convert_ids_to_tokens(i))
            else:
                run.append(i)
        if run:
            parts.append(self.tokenizer.decode(run, skip_special_tokens=False))
        return " ".join(parts)

    def _prime(self, context: list[int]) -> bool:
        """Feed the context to the stream (its text is not output); False when the stream fails,
        so the window decodes instead."""
        stream, backend = self._stream
        try:
            for token_id in context:
                stream.step(backend, token_id)
        except Exception:
            return False
        return True

    def _advance(self, flush: bool) -> str:
        """Text the window's unread tokens add; '' while it ends in an unfinished char."""
        if self._stream is not None and not flush:
            stream, backend = self._stream
            try:
                piece = stream.step(backend, self._ids[-1])
            except Exception:  # a prefix the stream cannot continue: the window takes over
                self._stream = None
                return self._advance(flush)
            if piece is None:
                return ""
            self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
            return piece
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text):
            return ""  # e.g. a skipped special token
        if new_text.endswith(_REPLACEMENT_CHAR) and not flush:
            return ""  # wait: the next token may complete the character
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return new_text[len(prefix_text) :]

    # -- text and stop strings ----------------------------------------------------------------

    def _add_text(self, piece: str) -> None:
        start = max(0, len(self.text) - self._hold)
        self.text += piece
        if not self.stop or len(self.token_ids) <= self.min_tokens:
            return
        best: tuple[int, str] | None = None
        for s in self.stop:
            idx = self.text.find(s, start)
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, s)
        if best is not None:
            idx, s = best
            self.text = self.text[: idx + len(s) if self.include_stop_str_in_output else idx]
            self.stop_string_hit = s
            self.finished = True

    def append(self, new_token_ids: Iterable[int]) -> str:
        """Add generated tokens; return the text they add to `.text`.

        Tokens after the one that completes a stop string are ignored (not recorded). The return
        value is not held back for stop strings, and when a stop string that began in earlier
        text is cut away it can be '' while `.text` got shorter: stream `output_text_delta()`."""
        before = len(self.text)
        for token_id in new_token_ids:
            if self.finished:
                break
            self._ids.append(int(token_id))
            self.token_ids.append(int(token_id))
            piece = self._advance(flush=False)
            if piece:
                self._add_text(piece)
        return self.text[before:]

    def finish(self) -> str:
        """Mark the sequence ended (EOS, length...): flush a trailing unfinished character and
        release held-back text. Returns the text this adds to `.text`. Idempotent."""
        before = len(self.text)
        if not self.finished:
            if self._read_offset < len(self._ids):
                piece = self._advance(flush=True)
                if piece:
                    self._add_text(piece)
            self.finished = True
        return self.text[before:]

    @property
    def stable_text(self) -> str:
        """The text that can no longer change: all of it once finished, else minus the hold."""
        return self.text if self.finished else self.text[: max(0, len(self.text) - self._hold)]

    def output_text_delta(self) -> str:
        """Text not handed out before that can no longer be cut by a stop string.

        While the sequence runs, the last `max_stop_len - 1` characters are held back (nothing
        is held without stop strings); once `finished`, everything left is released."""
        end = len(self.text) if self.finished else len(self.text) - self._hold
        if end <= self._output_offset:
            return ""
        delta = self.text[self._output_offset : end]
        self._output_offset = end
        return delta


def _decode_stream(tokenizer: PreTrainedTokenizerBase, skip_special_tokens: bool) -> tuple | None:
    """(DecodeStream, the backend it decodes with) for a fast tokenizer whose decode is its
    backend's as it is; None otherwise (a tokenizer that cleans up spaces, or has no backend)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None
    try:
        from tokenizers import Tokenizer
        from tokenizers.decoders import DecodeStream
        from transformers import PreTrainedTokenizerFast
    except ImportError:
        return None
    if not isinstance(backend, Tokenizer) or not isinstance(tokenizer, PreTrainedTokenizerFast):
        return None
    kind = type(tokenizer)
    if kind.decode is not PreTrainedTokenizerFast.decode or \
            kind._decode is not PreTrainedTokenizerFast._decode:
        return None  # decodes its own way
    return DecodeStream(skip_special_tokens=skip_special_tokens), backend


def _special_ids(tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    ids = set(getattr(tokenizer, "all_special_ids", ()))
    for token_id, token in getattr(tokenizer, "added_tokens_decoder", {}).items():
        if getattr(token, "special", False):
            ids.add(token_id)
    return frozenset(ids)
