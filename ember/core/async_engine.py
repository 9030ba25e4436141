"""Deprecated home of AsyncLLM: it moved to `ember.engine.async_llm` (the front end)."""

from ember.deprecation import moved_names

__getattr__ = moved_names(__name__, {
    "AsyncLLM": "ember.engine.async_llm:AsyncLLM",
    "EngineDeadError": "ember.engine.errors:EngineDeadError",
    "IterationStats": "ember.engine.async_llm:IterationStats",
    "FinishedRequestStats": "ember.engine.async_llm:FinishedRequestStats",
})
