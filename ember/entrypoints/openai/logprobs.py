"""Engine logprobs (per position: token id -> Logprob) in OpenAI's two shapes.

Completions use the legacy shape (tokens, token_logprobs, top_logprobs, text_offset); chat uses
a list of {token, logprob, bytes, top_logprobs}. Both are built for a slice of positions so a
stream can send just the new tokens' logprobs with each chunk.
"""

from __future__ import annotations

from ember.entrypoints.openai.protocol import (
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionLogProbs,
    TopLogprob,
)
from ember.outputs import Logprob

_FLOOR = -9999.0  # JSON has no -inf; vLLM clamps the same way


class AsTokenIds:
    """Pass as `decode` for vLLM's return_tokens_as_token_ids: tokens named "token_id:<id>"."""


AS_TOKEN_IDS = AsTokenIds()


def _value(lp: float) -> float:
    return lp if lp > _FLOOR else _FLOOR


def _token_str(lp: Logprob | None, token_id: int, decode) -> str:
    if decode is AS_TOKEN_IDS:
        return f"token_id:{token_id}"
    if lp is not None and lp.decoded_token is not None:
        return lp.decoded_token
    return decode([token_id]) if decode is not None else f"token_id:{token_id}"


def append_completion_logprobs(
    out: CompletionLogProbs,
    token_ids: list[int],
    entries: list[dict[int, Logprob] | None],
    start_offset: int,
    decode,
) -> int:
    """Append positions (token_ids[i], entries[i]) to `out`; returns the next text offset.

    An entry of None (the first prompt token under echo) has no logprob."""
    offset = start_offset
    for token_id, entry in zip(token_ids, entries, strict=False):
        chosen = entry.get(token_id) if entry else None
        token = _token_str(chosen, token_id, decode)
        out.tokens.append(token)
        out.text_offset.append(offset)
        offset += len(token)
        if entry is None or chosen is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        out.token_logprobs.append(_value(chosen.logprob))
        # The sampled token plus the top-k (vLLM's convention); same-string tokens collapse.
        top = {}
        for tok_id, lp in entry.items():
            top.setdefault(_token_str(lp, tok_id, decode), _value(lp.logprob))
        out.top_logprobs.append(top)
    return offset


def prompt_logprobs_json(entries) -> list | None:
    """RequestOutput.prompt_logprobs in vLLM's response shape: per prompt token None or
    {token id: {logprob, rank, decoded_token}}."""
    if entries is None:
        return None
    return [None if entry is None else
            {tid: {"logprob": _value(lp.logprob), "rank": lp.rank,
                   "decoded_token": lp.decoded_token} for tid, lp in entry.items()}
            for entry in entries]


def _bytes(token: str) -> list[int]:
    return list(token.encode("utf-8", errors="replace"))


def chat_logprobs(
    token_ids: list[int],
    entries: list[dict[int, Logprob]],
    num_top: int,
    decode,
) -> ChatLogprobs:
    content = []
    for token_id, entry in zip(token_ids, entries, strict=False):
        chosen = entry.get(token_id)
        token = _token_str(chosen, token_id, decode)
        ranked = sorted(
            ((tid, lp) for tid, lp in entry.items() if lp.rank is not None and lp.rank <= num_top),
            key=lambda item: item[1].rank,
        )
        top = []
        for tid, lp in ranked[:num_top]:
            text = _token_str(lp, tid, decode)
            top.append(TopLogprob(token=text, logprob=_value(lp.logprob), bytes=_bytes(text)))
        content.append(
            ChatTokenLogprob(
                token=token,
                logprob=_value(chosen.logprob) if chosen is not None else _FLOOR,
                bytes=_bytes(token),
                top_logprobs=top,
            )
        )
    return ChatLogprobs(content=content)
