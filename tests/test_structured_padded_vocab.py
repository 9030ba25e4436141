"""Structured outputs with a model whose vocabulary is padded past its tokenizer (Qwen3 pads by
267 ids; a checkpoint given another model's tokenizer by ~100k): the grammar bitmask spans the
tokenizer's ids only, the tokens past it are disallowed under a grammar and left alone in rows
without one; on the CPU the sampler masks a narrow bitmask as a full-width one with zero words.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from ember import LLM, SamplingParams, StructuredOutputsParams

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "size": {"type": "integer", "minimum": 0, "maximum": 99},
    "kind": {"enum": ["a", "b", "c"]}}, "required": ["name", "size", "kind"]}


def test_narrow_bitmask_disallows_the_tokens_past_it():
    """A bitmask narrower than the logits: its tokens masked as it says, every token past its
    end -inf; xgrammar's CPU kernel (padded) and the byte-table path agree."""
    from ember.structured_output.bitmask import apply_token_bitmask_, unpack_bitmask

    gen = torch.Generator().manual_seed(0)
    vocab, words = 1000, 20  # the bitmask covers 640 of the 1000 tokens
    logits = torch.randn(5, vocab, generator=gen)
    bitmask = torch.randint(-2**31, 2**31 - 1, (5, words), dtype=torch.int32, generator=gen)
    allowed = unpack_bitmask(bitmask, vocab)
    assert not allowed[:, 32 * words:].any()
    for rows in (None, [3, 1]):
        index = list(range(5)) if rows is None else rows
        ref = logits.clone()
        ref[index] = ref[index].masked_fill(~allowed[index], float("-inf"))
        ours = apply_token_bitmask_(logits.clone(), bitmask,
                                    None if rows is None else torch.tensor(rows), rows)
        assert torch.equal(ours, ref)
        assert torch.isinf(ours[index, 32 * words:]).all()


def _padded_model(tmp_path, padding: int, config_eos_past_tokenizer: bool = False
                  ) -> tuple[str, int]:
    """A tiny random Qwen3 whose embedding has `padding` ids past its small byte-level BPE
    tokenizer (trained here on JSON text); its config's eos is the tokenizer's, or with
    `config_eos_past_tokenizer` the middle padding id (a config paired with another tokenizer)."""
    from model_factory import make_tiny_model
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    texts = [json.dumps({"name": n, "size": i, "kind": k})
             for i, (n, k) in enumerate([("box", "a"), ("crate", "b"), ("bag", "c")] * 20)]
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    vocab_size = len(fast) + padding
    path = make_tiny_model("qwen3", tmp_path, vocab_size=vocab_size,
                           eos_token_id=len(fast) + padding // 2 if config_eos_past_tokenizer
                           else fast.eos_token_id)
    fast.save_pretrained(path)
    return str(path), len(fast)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
def test_padded_vocabulary(tmp_path, backend):
    """Random weights, 8x more padding ids than tokens: constrained outputs validate and use
    tokenizer ids only, with a bitmask as wide as the tokenizer; an unconstrained request in the
    same steps still samples padding ids (its row is not masked). Greedy rows alone take the
    runner's masked-argmax path, mixed with sampled rows the sampler's."""
    path, num_tokens = _padded_model(tmp_path, padding=8 * 400)
    llm = LLM(path, max_model_len=256, structured_outputs_config={"backend": backend})
    try:
        params = [SamplingParams(temperature=0.0 if i % 2 == 0 else 1.0, seed=i, max_tokens=80,
                                 structured_outputs=StructuredOutputsParams(
                                     json=SCHEMA, disable_any_whitespace=True))
                  for i in range(6)]
        greedy = llm.generate(["Answer with a JSON value:"] * 3, params[::2], use_tqdm=False)
        params.append(SamplingParams(temperature=1.0, seed=7, max_tokens=24, ignore_eos=True))
        outs = llm.generate(["Answer with a JSON value:"] * 7, params, use_tqdm=False)
        for out in greedy + outs[:6]:
            assert out.outputs[0].finish_reason == "stop"
            assert max(out.outputs[0].token_ids) < num_tokens
            # Random weights pick control characters inside strings: parse leniently.
            jsonschema.validate(json.loads(out.outputs[0].text, strict=False), SCHEMA)
        assert max(outs[6].outputs[0].token_ids) >= num_tokens
        manager = llm.llm_engine.engine_core.structured_output
        assert manager.vocab_size == num_tokens
    finally:
        llm.shutdown()


@pytest.mark.slow
def test_config_eos_past_the_tokenizer(tmp_path):
    """The model config's eos id lies past the tokenizer (the H200 benchmark's Qwen3 config with
    the default model's tokenizer): the bitmask widens to cover it, so grammars build (xgrammar
    refuses a stop token past its table) and end; a request's own stop id past the bitmask is
    left out of its grammar's stop tokens instead of failing the build."""
    path, num_tokens = _padded_model(tmp_path, padding=200, config_eos_past_tokenizer=True)
    config_eos = num_tokens + 100
    llm = LLM(path, max_model_len=256)
    try:
        params = [SamplingParams(temperature=0.0, max_tokens=80, stop_token_ids=stop,
                                 structured_outputs=StructuredOutputsParams(
                                     json=SCHEMA, disable_any_whitespace=True))
                  for stop in (None, [config_eos + 50])]
        outs = llm.generate(["Answer with a JSON value:"] * 2, params, use_tqdm=False)
        for out in outs:
            assert out.outputs[0].finish_reason == "stop"
            jsonschema.validate(json.loads(out.outputs[0].text, strict=False), SCHEMA)
        assert llm.llm_engine.engine_core.structured_output.vocab_size == config_eos + 1
    finally:
        llm.shutdown()
