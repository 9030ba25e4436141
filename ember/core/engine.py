"""Deprecated home of LLMEngine: it moved to `ember.engine.llm_engine` (the front end)."""

from __future__ import annotations

import importlib
import warnings
from typing import Any

_MOVED = {"LLMEngine": "ember.engine.llm_engine"}


def __getattr__(name: str) -> Any:
    if name not in _MOVED:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(f"ember.core.engine.{name} moved to {_MOVED[name]}.{name}",
                  DeprecationWarning, stacklevel=2)
    return getattr(importlib.import_module(_MOVED[name]), name)
