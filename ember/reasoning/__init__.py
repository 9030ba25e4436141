"""Reasoning parsers: separate a model's reasoning (``reasoning_content``) from its answer
(``content``), whole or streamed.

The contract is `ReasoningParser` (parser); the built-ins `qwen3` and `deepseek_r1` (builtin)
read ``<think>…</think>``. Parsers are resolved by name through
ember.registry.ReasoningParserRegistry (plugin hook ``ember_register_reasoning_parsers``).
Importing this package imports only the standard library.
"""

from __future__ import annotations

from typing import Any

from ember.reasoning.parser import ReasoningParser, ThinkTagReasoningParser


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    """The parser class registered as `name` (a ValueError lists the known names)."""
    from ember.registry import ReasoningParserRegistry

    return ReasoningParserRegistry.resolve(name)


def make_reasoning_parser(name: str, tokenizer: Any = None, *,
                          prompt: str | None = None) -> ReasoningParser:
    """A fresh parser for one response (streaming keeps state); `prompt` is the rendered prompt,
    which tells whether the chat template already opened the reasoning block."""
    return get_reasoning_parser(name)(tokenizer, prompt=prompt)


__all__ = ["ReasoningParser", "ThinkTagReasoningParser", "get_reasoning_parser",
           "make_reasoning_parser"]
