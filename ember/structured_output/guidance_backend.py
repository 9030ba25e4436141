"""The `guidance` grammar backend (llguidance): JSON schema (more of it than xgrammar: e.g.
patternProperties, string length with patterns, whitespace_pattern), regex, choice, Lark or GBNF
grammars and structural tags."""

from __future__ import annotations

import copy
import json
from typing import Any

from ember.structured_output.config import StructuredOutputsConfig
from ember.structured_output.interface import Grammar, GrammarSpec, StructuredOutputBackend


def _close_objects(schema: Any) -> Any:
    """disable_additional_properties: every object schema with properties gets
    additionalProperties: false unless it says otherwise."""
    if isinstance(schema, list):
        return [_close_objects(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: (v if k in ("enum", "const", "default", "examples") else _close_objects(v))
           for k, v in schema.items()}
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def serialize(spec: GrammarSpec) -> str:
    """The llguidance grammar text of a spec."""
    import llguidance

    kind = spec.kind
    if kind in ("json", "json_object"):
        schema = spec.json_schema()
        if spec.disable_additional_properties:
            schema = _close_objects(copy.deepcopy(schema))
        defaults: dict[str, Any] = {"whitespace_flexible": not spec.disable_any_whitespace}
        if spec.whitespace_pattern is not None:
            defaults["whitespace_pattern"] = spec.whitespace_pattern
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=defaults)
    if kind == "choice":
        return llguidance.grammar_from("choice", spec.value)
    if kind in ("regex", "grammar"):
        return llguidance.grammar_from(kind, spec.value)
    if kind == "structural_tag":
        tag = json.loads(spec.value)
        if not isinstance(tag, dict) or "structures" not in tag or "triggers" not in tag:
            raise ValueError("guidance takes a structural_tag with 'structures' and 'triggers'")
        tags = []
        for s in tag["structures"]:
            trigger = next((t for t in tag["triggers"] if s["begin"].startswith(t)), None)
            if trigger is None:
                raise ValueError(f"structural_tag: no trigger starts {s['begin']!r}")
            tags.append(llguidance.StructTag(
                trigger=trigger, begin=s["begin"], end=s["end"],
                grammar=llguidance.LLMatcher.grammar_from_json_schema(s["schema"])))
        return llguidance.StructTag.to_grammar(tags)
    raise ValueError(f"guidance: unknown structured output kind {kind!r}")


class GuidanceGrammar(Grammar):
    def __init__(self, matcher: Any, stop_token_ids: list[int]) -> None:
        self.matcher = matcher
        self.stop_token_ids = set(stop_token_ids)
        self._terminated = False

    def accept_token(self, token: int) -> bool:
        matcher = self.matcher
        if token in self.stop_token_ids and (matcher.is_stopped() or matcher.is_accepting()):
            self._terminated = True  # llguidance knows one eos; the engine may have several
            return True
        return matcher.consume_token(token)

    def fill_bitmask(self, bitmask, row: int) -> None:
        import llguidance.torch

        llguidance.torch.fill_next_token_bitmask(self.matcher, bitmask, row)

    def is_terminated(self) -> bool:
        # Stopped: nothing can follow (the grammar is complete), so the request ends here.
        return self._terminated or self.matcher.is_stopped()

    def rollback(self, num_tokens: int) -> None:
        self.matcher.rollback(num_tokens)
        self._terminated = False


class GuidanceBackend(StructuredOutputBackend):
    name = "guidance"
    fills_whole_rows = True  # its native fill writes the whole row

    @classmethod
    def validate(cls, spec: GrammarSpec) -> None:
        import llguidance

        try:
            grammar = serialize(spec)
        except ValueError:
            raise
        except Exception as exc:
            raise ValueError(f"guidance cannot compile the {spec.kind}: {exc}") from None
        error = llguidance.LLMatcher.validate_grammar(grammar, None)
        if error:
            raise ValueError(f"guidance cannot compile the {spec.kind}: {error.strip()}")

    def __init__(self, tokenizer: Any, vocab_size: int, config: StructuredOutputsConfig) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch
        import torch

        self.ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer, vocab_size)
        # Fills a step's bitmask rows in parallel on llguidance's own threads.
        self.executor = llguidance.LLExecutor()
        # llguidance builds its token tables on the first mask it computes (seconds): do it here,
        # on the grammar thread, rather than in the engine loop's first bitmask.
        warm = llguidance.LLMatcher(self.ll_tokenizer, llguidance.grammar_from("regex", "a"),
                                    log_level=0)
        llguidance.torch.fill_next_token_bitmask(
            warm, torch.zeros(1, (vocab_size + 31) // 32, dtype=torch.int32), 0)

    def compile(self, spec: GrammarSpec) -> Any:
        return serialize(spec)  # llguidance builds its parser lazily, per matcher

    def new_grammar(self, compiled: Any, stop_token_ids: list[int]) -> Grammar:
        import llguidance

        matcher = llguidance.LLMatcher(self.ll_tokenizer, compiled, log_level=0)
        error = matcher.get_error()
        if error:
            raise ValueError(f"guidance cannot compile the grammar: {error}")
        return GuidanceGrammar(matcher, stop_token_ids)

    def fill_bitmasks(self, grammars: list[Grammar], bitmask: Any, rows: list[int]) -> None:
        import llguidance.torch

        if len(grammars) == 1:
            grammars[0].fill_bitmask(bitmask, rows[0])
            return
        llguidance.torch.fill_next_token_bitmask_par(
            self.executor, [(g.matcher, row) for g, row in zip(grammars, rows)],  # type: ignore[attr-defined]
            bitmask)
