"""Platform selection: which device family this process runs on, and why.

Order (no silent fallback, no silent pick):
1. an explicit choice: `device=` ("cuda", "cuda:1", a plugin's name), else EMBER_PLATFORM. An
   unknown or unavailable choice is a ValueError with the reason;
2. else the one available out-of-tree platform (a plugin's, or one registered by user code). Two
   or more available is a ValueError naming them all;
3. else the built-ins: cuda if available, else cpu. Falling back to the CPU while a GPU is present
   but unusable (CPU-only torch, ROCm) is logged as a warning.
A platform's availability comes from its probe: the entry's "probe" capability ("module:function"
returning bool or (bool, reason)) if given, else the class's is_available().
"""

from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING, Any

from ember import envs

if TYPE_CHECKING:
    from ember.platforms.base import Platform

logger = logging.getLogger("ember.platforms")

BUILTIN_ORDER = ("cuda", "rocm", "cpu")
_instances: dict[tuple[str, str, int | None], Platform] = {}
_current: Platform | None = None


def probe_platform(name: str) -> tuple[bool, str]:
    """(available, reason when not) for a registered platform; a raising probe is unavailable."""
    from ember.registry import PlatformRegistry

    entry = PlatformRegistry.entry(name)
    try:
        probe = entry.capabilities.get("probe")
        if probe:
            module_name, _, attr = probe.partition(":")
            result: Any = getattr(importlib.import_module(module_name), attr)()
        else:
            cls = PlatformRegistry.resolve(name)
            result = cls.is_available()
            if not result:
                result = (False, cls.unavailable_reason() or "its is_available() is False")
    except Exception as exc:
        reason = f"its probe raised {type(exc).__name__}: {exc}"
        logger.warning("platform %r (%s): %s", name, entry.provider, reason)
        return False, reason
    if isinstance(result, tuple):
        ok, reason = bool(result[0]), str(result[1]) if len(result) > 1 else ""
    else:
        ok, reason = bool(result), ""
    return ok, ("" if ok else reason or "its probe returned False")


def _split_device(device: str) -> tuple[str, int | None]:
    name, sep, index = device.partition(":")
    if sep and not index.isdigit():
        raise ValueError(f"device {device!r}: expected 'name' or 'name:index'")
    return name, int(index) if sep else None


def choose_platform(device: str | None = None) -> tuple[str, int | None, list[str]]:
    """The platform name and device index that resolve_platform would use, and why (lines)."""
    from ember.registry import PlatformRegistry

    requested, source = (device, "device=") if device else (envs.platform(), "EMBER_PLATFORM=")
    if requested:
        name, index = _split_device(requested)
        if name not in PlatformRegistry:
            raise ValueError(
                f"unknown platform {name!r} (from {source}{requested!r}); "
                f"known: {', '.join(PlatformRegistry.names())}"
            )
        ok, reason = probe_platform(name)
        if not ok:
            raise ValueError(f"platform {name!r} (from {source}{requested!r}) is not "
                             f"available: {reason}")
        return name, index, [f"platform {name}: chosen, because {source}{requested!r}"]

    lines: list[str] = []
    available = []
    for entry in PlatformRegistry.entries():
        if entry.builtin:
            continue
        ok, reason = probe_platform(entry.name)
        lines.append(f"platform {entry.name} (out-of-tree, {entry.provider}): "
                     + ("available" if ok else f"unavailable: {reason}"))
        if ok:
            available.append(entry)
    if len(available) > 1:
        names = ", ".join(f"{e.name!r} ({e.provider})" for e in available)
        raise ValueError(
            f"several out-of-tree platforms are available: {names}; ember will not guess: choose "
            "one with device=... or EMBER_PLATFORM=..."
        )
    if available:
        lines.append(f"platform {available[0].name}: chosen, the one available out-of-tree "
                     "platform")
        return available[0].name, None, lines
    lines.extend(_failed_plugin_notes())

    unusable = []
    for name in BUILTIN_ORDER:
        if name not in PlatformRegistry or not PlatformRegistry.entry(name).builtin:
            continue
        ok, reason = probe_platform(name)
        if ok:
            lines.append(f"platform {name}: chosen, the first available built-in "
                         f"(order: {', '.join(BUILTIN_ORDER)})")
            if unusable:
                logger.warning("using platform %r although %s", name, "; ".join(unusable))
            return name, None, lines
        lines.append(f"platform {name} (built-in): unavailable: {reason}")
        if name != "cpu" and PlatformRegistry.resolve(name).detected():
            unusable.append(f"{name}: {reason}")
    raise ValueError("no platform is available:\n  " + "\n  ".join(lines))


def _failed_plugin_notes() -> list[str]:
    from ember.plugins.loader import get_report

    report = get_report()
    if report is None or not report.failed:
        return []
    names = ", ".join(repr(p.name) for p in report.failed)
    return [f"note: plugin(s) {names} failed to load; a platform they provide is not considered "
            "(see `ember plugins`)"]


def resolve_platform(device: str | None = None) -> Platform:
    """The Platform instance to run on (see the module docstring for the order)."""
    from ember.registry import PlatformRegistry

    name, index, lines = choose_platform(device)
    for line in lines:
        if line.startswith("note:"):
            logger.warning("%s", line[len("note: "):])
    cls = PlatformRegistry.resolve(name)
    key = (name, PlatformRegistry.entry(name).target, index)
    if key not in _instances:
        platform = cls()
        if index is not None:
            platform.device_index = index
        _instances[key] = platform
    return _instances[key]


def explain_platform(device: str | None = None) -> list[str]:
    """Why resolve_platform(device) picks what it picks (or the error it would raise)."""
    try:
        return choose_platform(device)[2]
    except ValueError as exc:
        return [f"error: {exc}"]


def current_platform() -> Platform:
    """The process's platform from EMBER_PLATFORM or detection, resolved once."""
    global _current
    if _current is None:
        _current = resolve_platform()
    return _current


__all__ = ["choose_platform", "current_platform", "explain_platform", "probe_platform",
           "resolve_platform"]
