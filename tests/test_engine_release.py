"""Dropping an LLM releases its model and KV cache (GPU memory, on CUDA): nothing about the
engine (async scheduling's step in flight, graph runners, collector settings) may keep it alive."""

from __future__ import annotations

import gc
import weakref

from model_factory import make_tiny_model

from ember import LLM, SamplingParams
from ember.gc_heap import freeze_imported_heap


def test_deleted_engine_is_collected(tmp_path):
    path = make_tiny_model("llama", tmp_path / "llama")
    freeze_imported_heap()  # the process's one freeze (of its imports), if no engine made it
    frozen = gc.get_freeze_count()
    llm = LLM(str(path), skip_tokenizer_init=True, max_model_len=64, async_scheduling=True)
    llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=4), use_tqdm=False)
    # A frozen object is never collected once it sits in a reference cycle (the CUDA graph
    # runner and the model runner point at each other): the engine must freeze nothing of its
    # own (ember.gc_heap).
    assert gc.get_freeze_count() <= frozen  # frozen objects freed by their count leave it
    runner = llm.llm_engine.executor.runner
    model_ref, cache_ref = weakref.ref(runner.model), weakref.ref(runner.kv_caches[0])
    del llm, runner
    gc.collect()
    assert model_ref() is None, "the model outlived its LLM"
    assert cache_ref() is None, "the KV cache outlived its LLM"
