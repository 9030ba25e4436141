"""Deprecated home of AsyncLLM: it moved to `ember.engine.async_llm` (the front end)."""

from __future__ import annotations

import importlib
import warnings
from typing import Any

_MOVED = {
    "AsyncLLM": "ember.engine.async_llm",
    "EngineDeadError": "ember.engine.errors",
    "IterationStats": "ember.engine.async_llm",
    "FinishedRequestStats": "ember.engine.async_llm",
}


def __getattr__(name: str) -> Any:
    if name not in _MOVED:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(f"ember.core.async_engine.{name} moved to {_MOVED[name]}.{name}",
                  DeprecationWarning, stacklevel=2)
    return getattr(importlib.import_module(_MOVED[name]), name)
