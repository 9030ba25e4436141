"""Deprecated home of LLMEngine: it moved to `ember.engine.llm_engine` (the front end)."""

from ember.deprecation import moved_names

__getattr__ = moved_names(__name__, {"LLMEngine": "ember.engine.llm_engine:LLMEngine"})
