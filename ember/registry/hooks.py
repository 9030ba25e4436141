"""The registries' one extension point: what runs before a registry is read, and what else
travels in a snapshot to worker processes.

The registries know nothing of plugins. The plugin loader (ember.plugins.loader) registers into
this module when it is imported, and `import ember` imports it, so every process that reads a
registry has plugin discovery wired in without the registry package importing the loader:

- `add_before_read(fn)`: `fn()` runs before every lookup or registration. It must be cheap once
  its work is done (the plugin loader returns at once after its first run).
- `add_snapshot_section(name, export, adopt)`: `snapshot()` stores `export()` under `name`, and
  `restore()` hands it to `adopt(data)` before it installs the registries' tables (the plugin
  loader's section is its load report, so a worker does not discover plugins again).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_before_read: list[Callable[[], None]] = []
_sections: dict[str, tuple[Callable[[], Any], Callable[[Any], None]]] = {}


def add_before_read(fn: Callable[[], None]) -> None:
    """Run `fn()` before any registry is read or written (once per callable, in order added)."""
    if fn not in _before_read:
        _before_read.append(fn)


def remove_before_read(fn: Callable[[], None]) -> None:
    if fn in _before_read:
        _before_read.remove(fn)


def run_before_read() -> None:
    """Called by every registry read and write."""
    for fn in tuple(_before_read):
        fn()


def add_snapshot_section(name: str, export: Callable[[], Any],
                         adopt: Callable[[Any], None]) -> None:
    """Carry `export()` in every snapshot under `name`; `restore` gives it to `adopt`."""
    if name in ("format", "registries"):
        raise ValueError(f"snapshot section name {name!r} is reserved")
    _sections[name] = (export, adopt)


def export_sections() -> dict[str, Any]:
    return {name: export() for name, (export, _) in _sections.items()}


def adopt_sections(snap: dict[str, Any]) -> None:
    for name, (_, adopt) in _sections.items():
        if name in snap:
            adopt(snap[name])

