"""Prompt types accepted by LLM.generate / LLMEngine.add_request (vLLM's names and keys).

Every key vLLM's TextPrompt / TokensPrompt define is listed; `PROMPT_KEYS` is what the engine
accepts, and the InputProcessor refuses, naming them, the keys it cannot honour (multimodal data
until multimodal models exist, token_type_ids, which only cross-encoders read) and unknown ones.
"""

from __future__ import annotations

from typing import Any, TypedDict

from typing_extensions import NotRequired


class TextPrompt(TypedDict):
    prompt: str
    multi_modal_data: NotRequired[dict[str, Any]]  # refused: no multimodal models yet
    mm_processor_kwargs: NotRequired[dict[str, Any]]  # refused, as above
    cache_salt: NotRequired[str]  # prefix-cache blocks are shared only with the same salt


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]
    prompt: NotRequired[str]
    token_type_ids: NotRequired[list[int]]  # refused: only cross-encoder (scoring) models use it
    multi_modal_data: NotRequired[dict[str, Any]]
    mm_processor_kwargs: NotRequired[dict[str, Any]]
    cache_salt: NotRequired[str]


PromptType = str | TextPrompt | TokensPrompt

# Keys the engine honours.
PROMPT_KEYS = frozenset({"prompt", "prompt_token_ids", "cache_salt"})
# vLLM keys refused with a reason, until what they need exists.
REFUSED_PROMPT_KEYS = {
    "multi_modal_data": "ember serves no multimodal models yet",
    "mm_processor_kwargs": "ember serves no multimodal models yet",
    "multi_modal_uuids": "ember serves no multimodal models yet",
    "token_type_ids": "only cross-encoder (scoring) models read token type ids; ember's models "
                      "are decoders",
    "prompt_embeds": "prompt embeddings as input are not supported",
}
