"""ember's plugin system: entry-point discovery, the versioned pluggy contract, the load report.

    from ember.plugins import hookimpl, load_plugins

`load_plugins()` runs once per process (registry lookups call it for you); `hookimpl` marks a
plugin's hook implementations (see ember.plugins.hookspecs and docs/plugins.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ember.plugins.loader import (
    GROUP,
    PluginLoadError,
    adopt_report,
    get_report,
    load_plugins,
)
from ember.plugins.report import PluginReport, PluginStatus

if TYPE_CHECKING:
    from ember.plugins.hookspecs import PLUGIN_API_VERSION, hookimpl, hookspec


def __getattr__(name: str) -> Any:
    # pluggy is imported only by plugins that mark hooks, and by the loader when it has work.
    if name in ("hookimpl", "hookspec", "PLUGIN_API_VERSION"):
        from ember.plugins import hookspecs

        return getattr(hookspecs, name)
    raise AttributeError(f"module 'ember.plugins' has no attribute {name!r}")


__all__ = [
    "GROUP",
    "PLUGIN_API_VERSION",
    "PluginLoadError",
    "PluginReport",
    "PluginStatus",
    "adopt_report",
    "get_report",
    "hookimpl",
    "hookspec",
    "load_plugins",
]
