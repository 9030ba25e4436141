"""The engine's old import paths (ember.core.engine, ember.core.async_engine) still resolve to the
front end's classes, with a DeprecationWarning, and unknown names still fail."""

from __future__ import annotations

import pytest


def test_old_engine_paths_warn_and_resolve():
    import ember.core.async_engine as old_async
    import ember.core.engine as old_engine
    from ember.engine.async_llm import AsyncLLM
    from ember.engine.errors import EngineDeadError
    from ember.engine.llm_engine import LLMEngine

    with pytest.warns(DeprecationWarning, match="ember.engine.llm_engine.LLMEngine"):
        assert old_engine.LLMEngine is LLMEngine
    with pytest.warns(DeprecationWarning):
        assert old_async.AsyncLLM is AsyncLLM
    with pytest.warns(DeprecationWarning):
        assert old_async.EngineDeadError is EngineDeadError
    with pytest.raises(AttributeError):
        old_engine.NotAName  # noqa: B018
