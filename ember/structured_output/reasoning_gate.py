"""ReasoningGate: where a request's answer starts, so that its grammar constrains the answer only.

With a reasoning parser configured (`structured_outputs_config.reasoning_parser`, which
`ember serve --reasoning-parser` sets, as vLLM does), a reasoning model first writes
``<think>…</think>`` freely and then its answer under the grammar. The gate works on token ids,
in the engine core: the parser's tags must each be one token of the tokenizer (they are for
Qwen3 and DeepSeek-R1); where they are not, the grammar applies from the first output token and
one warning says so.

Where the output starts is read from the prompt, scanning back from its end: an end tag first
(thinking turned off by the chat template, or a closed block) means the answer starts at once; a
start tag first means reasoning. A prompt with neither leaves it to the model when the parser
says outputs do not start inside reasoning (Qwen3's own template): the first token may open a
reasoning block or start the answer under the grammar ("undecided"); otherwise (DeepSeek-R1)
the output is reasoning until the end tag.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

logger = logging.getLogger("ember")

ANSWER, REASONING, UNDECIDED = "answer", "reasoning", "undecided"


class ReasoningGate:
    def __init__(self, parser_name: str, tokenizer: Any) -> None:
        from ember.reasoning import make_reasoning_parser

        parser = make_reasoning_parser(parser_name, tokenizer)
        ids = parser.tag_token_ids()
        self.start_id, self.end_id = ids if ids is not None else (None, None)
        self.starts_in_reasoning = bool(getattr(parser, "starts_in_reasoning", False))
        if ids is None:
            logger.warning("reasoning parser %r: its tags are not single tokens of this "
                           "tokenizer, so structured outputs apply from the first output token "
                           "(reasoning included)", parser_name)

    def initial_state(self, prompt_token_ids: Sequence[int]) -> str:
        """ANSWER, REASONING or UNDECIDED at the first output token."""
        if self.end_id is None:
            return ANSWER
        for token in reversed(prompt_token_ids):
            if token == self.end_id:
                return ANSWER
            if token == self.start_id:
                return REASONING
        return REASONING if self.starts_in_reasoning else UNDECIDED

    def advance(self, state: str, token: int) -> tuple[str, bool]:
        """(the state after `token` was sampled in `state`, whether the grammar takes it): in
        ANSWER it does; the end tag does not, nor a token while reasoning; in UNDECIDED a token
        other than the start tag is the answer's first, so the grammar takes it."""
        if state == ANSWER:
            return state, True
        after = self.next_state(state, token)
        return after, after == ANSWER and state == UNDECIDED

    def allow_start(self, bitmask: Any, rows: list[int]) -> None:
        """Also allow the start tag in `rows` of an int32 bitmask array (undecided rows: the
        first token may open a reasoning block)."""
        import numpy as np

        word, bit = divmod(self.start_id, 32)
        bitmask[rows, word] |= np.array(1 << bit, dtype=np.int64).astype(np.int32)

    def next_state(self, state: str, token: int) -> str:
        """The state after `token` was sampled in `state` (in UNDECIDED, a token other than the
        start tag is the answer's first token)."""
        if state == REASONING:
            return ANSWER if token == self.end_id else REASONING
        if state == UNDECIDED:
            return REASONING if token == self.start_id else ANSWER
        return state
