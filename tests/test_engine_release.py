"""Dropping an LLM releases its model and KV cache (GPU memory, on CUDA): nothing about the
engine (async scheduling's step in flight, graph runners, collector settings) may keep it alive."""

from __future__ import annotations

import gc
import weakref

from model_factory import make_tiny_model

from ember import LLM, SamplingParams


def test_deleted_engine_is_collected(tmp_path):
    path = make_tiny_model("llama", tmp_path / "llama")
    llm = LLM(str(path), skip_tokenizer_init=True, max_model_len=64, async_scheduling=True)
    llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=4), use_tqdm=False)
    # A frozen object is never collected once it sits in a reference cycle (the CUDA graph
    # runner and the model runner point at each other): the engine must not gc.freeze() the
    # user's process (ember.gc_heap).
    assert gc.get_freeze_count() == 0
    runner = llm.llm_engine.executor.runner
    model_ref, cache_ref = weakref.ref(runner.model), weakref.ref(runner.kv_caches[0])
    del llm, runner
    gc.collect()
    assert model_ref() is None, "the model outlived its LLM"
    assert cache_ref() is None, "the KV cache outlived its LLM"


def test_engine_held_by_an_application_in_a_cycle_is_collected(tmp_path):
    # The application object keeps a bound method of itself, so only the collector frees it:
    # had the engine frozen the process's heap while it was being built, it never would.
    path = make_tiny_model("llama", tmp_path / "llama")

    class App:
        def __init__(self) -> None:
            self.handler = self.handle
            self.llm = LLM(str(path), skip_tokenizer_init=True, max_model_len=64)

        def handle(self) -> None:
            pass

    app = App()
    model_ref = weakref.ref(app.llm.llm_engine.executor.runner.model)
    del app
    gc.collect()
    assert model_ref() is None, "the model outlived the application that held it"
