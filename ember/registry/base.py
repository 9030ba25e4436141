"""One generic lazy registry: name -> "module:attr" plus static capability data.

Listing or validating a registry never imports plugin code; `resolve` imports only the chosen
entry. Every registry is open: any string is a valid name.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Entry:
    """A registration: where the object lives, who registered it, and what it declares."""

    name: str
    target: str  # "package.module:Attr"
    owner: str = "ember"  # distribution (or "user") that registered it
    capabilities: dict[str, Any] = field(default_factory=dict)


class LazyRegistry(Generic[T]):
    """Maps names to lazily imported objects; errors list the valid names."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, Entry] = {}
        self._resolved: dict[str, T] = {}

    def register(
        self,
        name: str,
        target: str | T,
        *,
        owner: str = "user",
        capabilities: dict[str, Any] | None = None,
        override: bool = False,
    ) -> None:
        """Register `target` ("module:attr" or the object itself) under `name`."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.kind} name must be a non-empty string, got {name!r}")
        if name in self._entries and not override:
            raise ValueError(
                f"{self.kind} {name!r} is already registered by {self._entries[name].owner!r}; "
                f"{owner!r} cannot register it again without override=True"
            )
        if isinstance(target, str):
            if ":" not in target:
                raise ValueError(f"{self.kind} target must look like 'module:attr', got {target!r}")
            path = target
            self._resolved.pop(name, None)
        else:
            path = f"{getattr(target, '__module__', '?')}:{getattr(target, '__qualname__', '?')}"
            self._resolved[name] = target
        self._entries[name] = Entry(name, path, owner, dict(capabilities or {}))

    def names(self) -> list[str]:
        return sorted(self._entries)

    def entries(self) -> list[Entry]:
        return [self._entries[n] for n in self.names()]

    def entry(self, name: str) -> Entry:
        if name not in self._entries:
            raise ValueError(f"unknown {self.kind} {name!r}; known: {', '.join(self.names())}")
        return self._entries[name]

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def resolve(self, name: str) -> T:
        """Import (once) and return the object registered under `name`."""
        if name in self._resolved:
            return self._resolved[name]
        module_name, _, attr = self.entry(name).target.partition(":")
        obj: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
        self._resolved[name] = obj
        return obj
