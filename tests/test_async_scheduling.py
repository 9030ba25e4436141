"""Async scheduling (step N+1 planned and launched before step N's tokens are back) gives the
same tokens as the synchronous engine for every kind of request, and leaks nothing.

Runs on the CPU: the device tensors are CPU tensors there, but the placeholder bookkeeping, the
device-side feeding of sampled ids and the one-step-late stop handling are the same code as on CUDA.
"""

from __future__ import annotations

import random

import pytest
from conftest import assert_all_blocks_free
from model_factory import make_tiny_model

from ember import LLM, SamplingParams
from ember.worker.model_runner import ModelRunner


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return str(make_tiny_model("llama", tmp_path_factory.mktemp("llama")))


@pytest.fixture(scope="module")
def engines(tiny_path):
    kwargs = dict(skip_tokenizer_init=True, max_model_len=96, block_size=4)
    return (LLM(tiny_path, async_scheduling=False, **kwargs),
            LLM(tiny_path, async_scheduling=True, **kwargs))


def _prompts(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(3, 200) for _ in range(rng.randrange(1, 40))]}
            for _ in range(n)]


def _tokens(outputs) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outputs]


PARAMS = {
    "greedy_mixed_lengths": [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)
                             for m in (1, 2, 7, 20, 33, 5)],
    "seeded_random": [SamplingParams(temperature=0.9, top_p=0.9, top_k=20, seed=s, max_tokens=16)
                      for s in range(6)],
    "penalties_need_host_tokens": [
        SamplingParams(temperature=0.0, max_tokens=24, repetition_penalty=1.3,
                       frequency_penalty=0.5, presence_penalty=0.4),
        SamplingParams(temperature=0.0, max_tokens=24),
    ] * 3,
    "logprobs_and_min_tokens": [SamplingParams(temperature=0.0, max_tokens=12, logprobs=3,
                                               min_tokens=6)] * 6,
    "n_3_seeded": [SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=10)] * 2,
    "prompt_logprobs": [SamplingParams(temperature=0.0, max_tokens=8, prompt_logprobs=2)] * 4,
}


@pytest.mark.parametrize("case", list(PARAMS))
def test_async_equals_sync(engines, case, monkeypatch):
    sync_llm, async_llm = engines
    prompts = _prompts(len(PARAMS[case]), seed=len(case))
    fed = []
    original = ModelRunner._fill_placeholders
    monkeypatch.setattr(ModelRunner, "_fill_placeholders",
                        lambda self, *a: (fed.append(1), original(self, *a))[1])
    expected = sync_llm.generate(prompts, PARAMS[case], use_tqdm=False)
    assert not fed, "the synchronous engine never has a token in flight"
    got = async_llm.generate(prompts, PARAMS[case], use_tqdm=False)
    assert _tokens(got) == _tokens(expected)
    if any(p.max_tokens > 1 for p in PARAMS[case]):
        assert fed, "no step took its input tokens from the step in flight"
    for a, b in zip(got, expected):
        for ca, cb in zip(a.outputs, b.outputs):
            assert ca.finish_reason == cb.finish_reason
            if cb.logprobs is not None:
                assert [sorted(d) for d in ca.logprobs] == [sorted(d) for d in cb.logprobs]
        if b.prompt_logprobs is not None:
            assert [d and sorted(d) for d in a.prompt_logprobs] == [
                d and sorted(d) for d in b.prompt_logprobs]
    assert_all_blocks_free(async_llm)
    assert not async_llm.llm_engine.has_unfinished_requests()


def test_stop_tokens_end_one_step_late_without_extra_output(engines):
    """A request that samples a stop token is scheduled once more before the engine knows; that
    extra token must not reach the output."""
    sync_llm, async_llm = engines
    prompts = _prompts(4, seed=3)
    free = sync_llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=20,
                                                     ignore_eos=True), use_tqdm=False)
    # Stop at the third generated token of each request.
    params = [SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[o.outputs[0].token_ids[2]])
              for o in free]
    expected = sync_llm.generate(prompts, params, use_tqdm=False)
    got = async_llm.generate(prompts, params, use_tqdm=False)
    assert _tokens(got) == _tokens(expected)
    assert all(len(o.outputs[0].token_ids) <= 3 for o in got)
    assert {o.outputs[0].finish_reason for o in got} == {"stop"}
    assert_all_blocks_free(async_llm)


def test_abort_while_a_step_is_in_flight_frees_blocks(engines):
    _, async_llm = engines
    engine = async_llm.llm_engine
    for i, prompt in enumerate(_prompts(3, seed=5)):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=40, ignore_eos=True))
    engine.step()
    engine.step()  # now one step is in flight and r0..r2 hold blocks
    finals = engine.abort_request(["r0", "r1"])
    assert {o.outputs[0].finish_reason for o in finals} == {"abort"}
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert [o.request_id for o in outputs if o.finished] == ["r2"]
    assert len(outputs[-1].outputs[0].token_ids) == 40
    assert_all_blocks_free(async_llm)


def test_preemption_with_tokens_in_flight(tiny_path):
    """A KV cache so small that running requests are preempted while their last token is still
    being sampled: they resume with that token and finish exactly as without async scheduling."""
    kwargs = dict(skip_tokenizer_init=True, max_model_len=96, block_size=4, num_gpu_blocks_override=24)
    prompts = _prompts(6, seed=9)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    expected = LLM(tiny_path, async_scheduling=False, **kwargs).generate(prompts, params, use_tqdm=False)
    llm = LLM(tiny_path, async_scheduling=True, **kwargs)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    assert _tokens(got) == _tokens(expected)
    assert_all_blocks_free(llm)
