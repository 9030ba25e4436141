"""StructuredOutputsConfig: the engine-wide structured-outputs settings (vLLM's names)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any


@dataclass
class StructuredOutputsConfig:
    """`backend`: "auto" (xgrammar, or guidance for what xgrammar cannot compile, as vLLM's
    auto), "xgrammar", "guidance" or any name in ember.registry.GrammarBackendRegistry.
    `disable_any_whitespace` / `disable_additional_properties` apply to every request's JSON
    (a request's own StructuredOutputsParams flags add to them). `max_cache_size`: compiled
    grammars kept for reuse (keyed by backend and spec). `reasoning_parser`: a
    ReasoningParserRegistry name; the grammar then applies to the answer after the reasoning
    (ember.structured_output.reasoning_gate), or to everything with `enable_in_reasoning`."""

    backend: str = "auto"
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    max_cache_size: int = 512
    # vLLM's: with a reasoning parser (`ember serve --reasoning-parser` sets it), the grammar
    # constrains the answer after the reasoning only, unless `enable_in_reasoning`.
    reasoning_parser: str | None = None
    enable_in_reasoning: bool = False

    @classmethod
    def of(cls, value: Any) -> StructuredOutputsConfig:
        """A config from a StructuredOutputsConfig, a dict of its fields, or None (defaults)."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError("structured_outputs_config must be a StructuredOutputsConfig or a "
                             f"dict, got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"structured_outputs_config: unknown field(s) {', '.join(unknown)}; "
                             f"known: {', '.join(sorted(known))}")
        return cls(**value)

    def validate(self) -> None:
        from ember.registry import GrammarBackendRegistry

        if self.backend != "auto" and self.backend not in GrammarBackendRegistry:
            raise ValueError(
                f"structured_outputs_config.backend {self.backend!r} is not a grammar backend; "
                f"known: auto, {', '.join(GrammarBackendRegistry.names())}")
        if self.reasoning_parser:
            from ember.registry import ReasoningParserRegistry

            if self.reasoning_parser not in ReasoningParserRegistry:
                raise ValueError(
                    f"structured_outputs_config.reasoning_parser {self.reasoning_parser!r} is "
                    f"not a reasoning parser; known: "
                    f"{', '.join(ReasoningParserRegistry.names())}")
        if not isinstance(self.max_cache_size, int) or self.max_cache_size < 1:
            raise ValueError("structured_outputs_config.max_cache_size must be >= 1, "
                             f"got {self.max_cache_size!r}")
