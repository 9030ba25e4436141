"""`compile_model=True` (torch.compile of the whole forward, the attention layers one opaque op
each) gives the eager engine's tokens: prefill, chunked prefill mixed with decodes, and decode
steps, on two decoder variants; dynamo breaks no graph, and the steps after start-up compile
nothing new (what lets the runner skip dynamo's full guard check after the warm-up)."""

from __future__ import annotations

import random

import pytest
from conftest import assert_all_blocks_free
from model_factory import make_tiny_model

from ember import LLM, SamplingParams


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_compiled_model_equals_eager(arch, tmp_path):
    path = str(make_tiny_model(arch, tmp_path / arch, num_hidden_layers=2))
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 200) for _ in range(n)]}
               for n in (1, 9, 17, 40)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    kwargs = dict(skip_tokenizer_init=True, max_model_len=96, max_num_batched_tokens=16)
    expected = LLM(path, **kwargs).generate(prompts, params, use_tqdm=False)
    from torch._dynamo.utils import counters

    counters.clear()
    llm = LLM(path, compile_model=True, **kwargs)
    runner = llm.llm_engine.executor.runner
    assert runner.skip_guards
    graphs = counters["stats"]["unique_graphs"]
    assert graphs == 2  # one token, and any other count (dynamo specializes 1)
    runner.skip_guards = False  # every guard checked: would a step compile a new graph?
    checked = llm.generate(prompts, params, use_tqdm=False)
    assert counters["stats"]["unique_graphs"] == graphs
    runner.skip_guards = True
    got = llm.generate(prompts, params, use_tqdm=False)
    assert not counters["graph_break"], dict(counters["graph_break"])
    want = [o.outputs[0].token_ids for o in expected]
    assert [o.outputs[0].token_ids for o in checked] == want
    assert [o.outputs[0].token_ids for o in got] == want
    assert_all_blocks_free(llm)
