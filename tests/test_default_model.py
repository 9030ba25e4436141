"""The embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF) end to end.

Greedy ids of the dequantized model (quantization="none") must equal HF transformers loading the
same GGUF (float32, CPU) on 8 chat prompts x 64 new tokens; logprobs must equal the reference
log_softmax; the public API behaves like vLLM's.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from conftest import assert_all_blocks_free
from reference import check_greedy_match, ember_top5, hf_greedy

from ember import LLM, SamplingParams

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "List three primary colors.",
    "What is 12 times 7?",
    "Give me a tip for learning to cook.",
    "Translate 'good morning' into Spanish.",
    "Why is the sky blue?",
]
MAX_NEW = 64


@pytest.fixture(scope="module")
def llm():
    # The float model (its GGUF dequantized at load), compared exactly with HF's float32; the
    # default, kept-quantized model is compared with it in test_gguf_quant.py.
    return LLM(quantization="none")


@pytest.fixture(scope="module")
def chat_prompts(llm):
    tok = llm.get_tokenizer()
    return [
        list(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                     tokenize=True, return_dict=False))
        for q in QUESTIONS
    ]


@pytest.fixture(scope="module")
def hf_model():
    from transformers import AutoModelForCausalLM

    from ember.default_model import default_model_path

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
    )
    return model.eval()


@pytest.mark.slow
def test_greedy_chat_matches_hf(llm, chat_prompts, hf_model):
    eos = llm.llm_engine.eos_token_ids
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, logprobs=5)
    outputs = llm.generate([{"prompt_token_ids": p} for p in chat_prompts], params)
    assert_all_blocks_free(llm)
    notes = []
    for i, (prompt, out) in enumerate(zip(chat_prompts, outputs)):
        ref = hf_greedy(hf_model, prompt, MAX_NEW, eos)
        completion = out.outputs[0]
        note = check_greedy_match(ref, completion.token_ids, ember_top5(completion), f"chat[{i}]")
        if note:
            notes.append(note)
        # Logprobs are log_softmax of the reference logits (same weights, float32).
        for pos in range(min(len(ref.top5), len(completion.logprobs))):
            if completion.token_ids[: pos + 1] != ref.token_ids[: pos + 1]:
                break
            for tok, lp in completion.logprobs[pos].items():
                if tok in ref.top5[pos]:
                    assert math.isclose(lp.logprob, ref.top5[pos][tok], abs_tol=2e-3)
    print("\n".join(notes))
    assert len(notes) <= 2, notes  # near-ties are rare; many would mean a real numeric bug


def test_default_model_answers(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0.0, max_tokens=32))
    assert out[0].outputs[0].text.strip() == "The capital of France is Paris."
    assert out[0].outputs[0].finish_reason == "stop"
    assert_all_blocks_free(llm)


def test_prompt_forms_and_per_prompt_params(llm):
    tok = llm.get_tokenizer()
    ids = tok.encode("The quick brown fox")
    params = [SamplingParams(temperature=0, max_tokens=5), SamplingParams(temperature=0, max_tokens=3),
              SamplingParams(temperature=0, max_tokens=5)]
    outs = llm.generate(["The quick brown fox", {"prompt_token_ids": ids},
                         {"prompt": "The quick brown fox"}], params)
    assert [len(o.outputs[0].token_ids) for o in outs] == [5, 3, 5]
    assert outs[0].outputs[0].token_ids == outs[2].outputs[0].token_ids
    assert outs[0].outputs[0].token_ids[:3] == outs[1].outputs[0].token_ids
    assert outs[0].outputs[0].finish_reason == "length"
    assert outs[0].prompt_token_ids == ids
    m = outs[0].metrics
    assert m.arrival_time <= m.first_token_time <= m.finished_time


def test_stop_strings_cut_text_exactly(llm):
    greedy = SamplingParams(temperature=0, max_tokens=20)
    full = llm.generate("Count: one, two, three, four,", greedy)[0].outputs[0].text
    assert len(full) > 10
    stop = full[4:7]
    cut = llm.generate("Count: one, two, three, four,",
                       SamplingParams(temperature=0, max_tokens=20, stop=[stop]))[0].outputs[0]
    assert cut.text == full[: full.index(stop)]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    kept = llm.generate(
        "Count: one, two, three, four,",
        SamplingParams(temperature=0, max_tokens=20, stop=[stop], include_stop_str_in_output=True),
    )[0].outputs[0]
    assert kept.text == full[: full.index(stop) + len(stop)]
    assert_all_blocks_free(llm)


def test_stop_token_ids_and_min_tokens(llm):
    greedy = SamplingParams(temperature=0, max_tokens=10)
    ids = llm.generate("Hello there,", greedy)[0].outputs[0].token_ids
    out = llm.generate("Hello there,", SamplingParams(temperature=0, max_tokens=10,
                                                      stop_token_ids=[ids[2]]))[0].outputs[0]
    assert out.token_ids == ids[:3] and out.finish_reason == "stop" and out.stop_reason == ids[2]
    eos = next(iter(llm.llm_engine.eos_token_ids))
    out = llm.generate("Hi", SamplingParams(temperature=0, max_tokens=12, min_tokens=12))[0]
    assert len(out.outputs[0].token_ids) == 12 and eos not in out.outputs[0].token_ids


def test_seeded_sampling_reproduces_alone_and_batched(llm):
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=42, max_tokens=16)
    alone = llm.generate("Tell me a story", seeded)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=0.8, max_tokens=16)] * 3
    batched = llm.generate(["Once upon", "Tell me a story", "Hello", "Why"],
                           [others[0], seeded, others[1], others[2]])
    assert batched[1].outputs[0].token_ids == alone
    different = llm.generate("Tell me a story", SamplingParams(temperature=1.0, top_p=0.9, seed=7,
                                                               max_tokens=16))
    assert different[0].outputs[0].token_ids != alone


def test_top_k_one_equals_greedy(llm):
    greedy = llm.generate("The weather today", SamplingParams(temperature=0, max_tokens=12))
    topk1 = llm.generate("The weather today",
                         SamplingParams(temperature=1.0, top_k=1, max_tokens=12, seed=3))
    assert greedy[0].outputs[0].token_ids == topk1[0].outputs[0].token_ids


def test_n_samples_and_prompt_logprobs(llm):
    out = llm.generate("Name a fruit:", SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=8,
                                                      prompt_logprobs=2))[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1
    assert out.prompt_logprobs[0] is None
    assert len(out.prompt_logprobs) == len(out.prompt_token_ids)
    for pos, entry in enumerate(out.prompt_logprobs[1:], start=1):
        assert out.prompt_token_ids[pos] in entry
    assert_all_blocks_free(llm)


def test_engine_step_api_and_abort(llm):
    engine = llm.llm_engine
    engine.add_request("keep", "Hello", SamplingParams(temperature=0, max_tokens=6))
    engine.add_request("drop", "Goodbye", SamplingParams(temperature=0, max_tokens=50))
    engine.step()
    engine.abort_request("drop")
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert set(finished) == {"keep"} and len(finished["keep"].outputs[0].token_ids) == 6
    assert_all_blocks_free(llm)


BAD_PARAMS = [
    (dict(max_tokens=0), "max_tokens"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(temperature=-1.0), "temperature"),
    (dict(n=0), "n"),
]


@pytest.mark.parametrize("kwargs,field", BAD_PARAMS)
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_bad_prompts_fail_alone_and_engine_keeps_serving(llm):
    engine = llm.llm_engine
    with pytest.raises(ValueError, match="empty"):
        llm.generate("", SamplingParams(max_tokens=4))
    too_long = {"prompt_token_ids": [5] * (engine.max_model_len + 1)}
    with pytest.raises(ValueError, match="maximum model length"):
        llm.generate(["ok prompt", too_long], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="vocabulary"):
        llm.generate({"prompt_token_ids": [10**9]}, SamplingParams(max_tokens=4))
    assert_all_blocks_free(llm)
    out = llm.generate("Still working?", SamplingParams(temperature=0, max_tokens=4))
    assert len(out[0].outputs[0].token_ids) == 4
