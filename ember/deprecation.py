"""Deprecated aliases: a module whose names moved keeps answering for them, with a warning.

`__getattr__ = moved_names(__name__, {"Old": "new.module:New"})` in the old module resolves each
old name lazily (importing nothing until it is used) and warns once per use.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable
from typing import Any


def moved_names(module: str, moved: dict[str, str]) -> Callable[[str], Any]:
    """A module `__getattr__` for names that now live at "package.module:attr"."""

    def __getattr__(name: str) -> Any:
        target = moved.get(name)
        if target is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        new_module, _, new_name = target.partition(":")
        warnings.warn(f"{module}.{name} moved to {new_module}.{new_name}", DeprecationWarning,
                      stacklevel=2)
        return getattr(importlib.import_module(new_module), new_name)

    return __getattr__
