"""Structured outputs with a reasoning parser: the grammar constrains the answer after
``</think>`` only (vLLM's `structured_outputs_config.reasoning_parser`), on a tiny random Qwen3
whose tokenizer has ``<think>`` and ``</think>`` as single tokens, as Qwen3's has.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
from model_factory import make_tiny_model

from ember import LLM, SamplingParams
from ember.sampling_params import StructuredOutputsParams

SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 8}},
          "required": ["answer"], "additionalProperties": False}


@pytest.fixture(scope="module")
def think_model(tmp_path_factory):
    from ember.default_model import default_model_path
    from ember.tokenizer import load_tokenizer

    root = tmp_path_factory.mktemp("think")
    tokenizer = load_tokenizer(default_model_path())
    tokenizer.add_special_tokens({"additional_special_tokens": ["<think>", "</think>"]})
    tokenizer.save_pretrained(root / "tok")
    model = make_tiny_model("qwen3", root / "model", vocab_size=49216)
    ids = {tag: tokenizer.convert_tokens_to_ids(tag) for tag in ("<think>", "</think>")}
    return str(model), str(root / "tok"), ids


def _llm(think_model, **structured_config) -> LLM:
    model, tok, _ = think_model
    return LLM(model=model, tokenizer=tok, max_model_len=256,
               structured_outputs_config=structured_config)


def _ids(llm: LLM, text: str) -> list[int]:
    return llm.get_tokenizer().encode(text, add_special_tokens=False)


def _run(llm, prompt_ids, **params):
    out = llm.generate([{"prompt_token_ids": prompt_ids}],
                       SamplingParams(temperature=0, **params), use_tqdm=False)
    return out[0].outputs[0]


@pytest.mark.slow
def test_grammar_waits_for_the_end_of_reasoning(think_model):
    _, _, tags = think_model
    gated = _llm(think_model, reasoning_parser="qwen3")
    everywhere = _llm(think_model, reasoning_parser="qwen3", enable_in_reasoning=True)
    strict = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    json_params = dict(structured_outputs=strict, max_tokens=40)
    base = _ids(gated, "Question: what is it?")

    # The prompt opened a reasoning block: tokens are free until </think>, as without a grammar.
    reasoning = base + [tags["<think>"]]
    free = _run(gated, reasoning, max_tokens=12)
    assert tags["</think>"] not in free.token_ids
    assert list(_run(gated, reasoning, **{**json_params, "max_tokens": 12}).token_ids) == \
        list(free.token_ids)
    # ... while enable_in_reasoning constrains them too.
    constrained = _run(everywhere, reasoning, **json_params)
    jsonschema.validate(json.loads(constrained.text), SCHEMA)

    # The prompt closed the block (thinking off): the answer starts at once, under the grammar.
    closed = base + [tags["<think>"], tags["</think>"]]
    out = _run(gated, closed, **json_params)
    jsonschema.validate(json.loads(out.text), SCHEMA)
    assert out.finish_reason == "stop"

    # Reasoning that ends in the output: the grammar applies from the token after </think>.
    forced_end = _run(gated, reasoning, logit_bias={tags["</think>"]: 100.0}, **json_params)
    ids = list(forced_end.token_ids)
    assert ids[0] == tags["</think>"]
    answer = gated.get_tokenizer().decode(ids[1:], skip_special_tokens=True)
    jsonschema.validate(json.loads(answer), SCHEMA)


@pytest.mark.slow
@pytest.mark.parametrize("grammar_process", ["0", "1"])
def test_undecided_start_allows_opening_a_reasoning_block(think_model, monkeypatch,
                                                          grammar_process):
    """Without tags in the prompt (Qwen3's template with thinking on), the first token may open
    a reasoning block or start the answer under the grammar; with the grammars on the engine's
    threads and in the grammar process (the gate stays in the engine)."""
    _, _, tags = think_model
    monkeypatch.setenv("EMBER_GRAMMAR_PROCESS", grammar_process)
    gated = _llm(think_model, reasoning_parser="qwen3")
    assert gated.llm_engine.engine_core.structured_output.uses_process == (grammar_process == "1")
    base = _ids(gated, "Question: what is it?")
    choice = StructuredOutputsParams(choice=["yes", "no"])
    # Biased toward <think>: it is allowed at the first token, then the output is free.
    opened = _run(gated, base, structured_outputs=choice, max_tokens=6,
                  logit_bias={tags["<think>"]: 100.0})
    assert opened.token_ids[0] == tags["<think>"]
    # Not opened: the answer is one of the choices.
    answer = _run(gated, base, structured_outputs=choice, max_tokens=6)
    assert answer.text in ("yes", "no") and answer.finish_reason == "stop"


def test_unknown_reasoning_parser_is_refused(think_model):
    with pytest.raises(ValueError, match="reasoning_parser"):
        _llm(think_model, reasoning_parser="no-such-parser")
