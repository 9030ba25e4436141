"""Every EMBER_* environment variable, read in one place (lazily, so tests can set them)."""

from __future__ import annotations

import os


def _str(name: str, default: str | None = None) -> str | None:
    value = os.environ.get(name)
    return default if value is None or value == "" else value


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def plugins_allowlist() -> list[str] | None:
    """EMBER_PLUGINS: comma-separated plugin names to load; unset = all, empty string = none."""
    value = os.environ.get("EMBER_PLUGINS")
    if value is None:
        return None
    return [name.strip() for name in value.split(",") if name.strip()]


def plugins_strict() -> bool:
    """EMBER_PLUGINS_STRICT=1: a plugin that fails to load is fatal instead of reported."""
    return _flag("EMBER_PLUGINS_STRICT")


def platform() -> str | None:
    """EMBER_PLATFORM: force a platform by name (same as device=...)."""
    return _str("EMBER_PLATFORM")


def attention_backend() -> str | None:
    """EMBER_ATTENTION_BACKEND: force an attention backend by name."""
    return _str("EMBER_ATTENTION_BACKEND")


def logging_level() -> str:
    """EMBER_LOGGING_LEVEL: the ember logger's level (default INFO)."""
    return _str("EMBER_LOGGING_LEVEL", "INFO") or "INFO"


def disable_progress_bars() -> bool:
    """EMBER_DISABLE_PROGRESS=1: no tqdm bars (weight loading, offline generate)."""
    return _flag("EMBER_DISABLE_PROGRESS")
