"""Plugin discovery and loading: entry points in group ``ember.plugins``, once per process.

Each entry point is a pluggy plugin (a module, an object, or a class instantiated without
arguments) implementing hooks of ember.plugins.hookspecs; a plain function is accepted too and
called with no arguments (vLLM's ``register()`` style). Each plugin is loaded in isolation:
- its registrations are attributed to its distribution (name and version);
- if its import, hook validation or any hook raises, everything it registered is rolled back, the
  failure is recorded with its traceback and logged once, and the other plugins load normally;
- hooks are called per plugin (not through one pluggy call) so one plugin's exception cannot stop
  another's hooks.
EMBER_PLUGINS (comma-separated entry-point or distribution names; unset = all, empty = none)
filters what is imported at all; EMBER_PLUGINS_STRICT=1 turns any failure into PluginLoadError.

A failure is logged as one line (the plugin and its error); its traceback goes to the DEBUG log
and to the report (`ember plugins -v` prints it).

Wiring: importing this module registers `load_plugins` with ember.registry.hooks (run before any
registry read) and the load report as the snapshot's "plugins" section (so a worker process adopts
its parent's report instead of discovering plugins again). The dependency goes one way: plugins
know the registries, the registries know nothing of plugins.
"""

from __future__ import annotations

import sys
import threading
import types
from typing import Any

from ember import envs
from ember.plugins.report import FAILED, LOADED, MISSING, SKIPPED, PluginReport, PluginStatus
from ember.registry import hooks

GROUP = "ember.plugins"


def _logger() -> Any:
    import logging  # imported on use: `import ember.plugins` must stay cheap

    return logging.getLogger("ember.plugins")


class PluginLoadError(RuntimeError):
    """Raised in strict mode when a plugin fails to load (or an allow-listed one is missing).

    The message's first line says which plugin and why; the plugin's traceback follows it.
    """


_lock = threading.RLock()
_state = "new"  # "new" -> "loading" -> "done"
_report: PluginReport | None = None
_fatal: PluginLoadError | None = None


def load_plugins() -> PluginReport:
    """Discover and load the installed plugins (once per process) and return the report."""
    global _state, _report, _fatal
    if _state == "done":
        if _fatal is not None:
            raise _fatal
        return _report  # type: ignore[return-value]
    with _lock:
        if _state == "loading":  # re-entered from a plugin's hook (a registry read/write)
            return _report  # type: ignore[return-value]
        if _state == "new":
            _state = "loading"
            _report = PluginReport(allowlist=envs.plugins_allowlist(), strict=envs.plugins_strict())
            try:
                _load_all(_report)
            except PluginLoadError as exc:
                _fatal = exc
            finally:
                _state = "done"
        if _fatal is not None:
            raise _fatal
        return _report  # type: ignore[return-value]


def get_report() -> PluginReport | None:
    """The report of this process's plugin load, or None if plugins were not loaded yet."""
    return _report


def adopt_report(report: PluginReport) -> None:
    """Mark plugins as loaded with a parent's report (the registries come from its snapshot)."""
    global _state, _report, _fatal
    with _lock:
        _state, _report, _fatal = "done", report, None


def _export_report() -> dict[str, Any]:
    return load_plugins().to_dict()


def _adopt_report_data(data: dict[str, Any]) -> None:
    adopt_report(PluginReport.from_dict(data))


def reset_for_tests() -> None:
    """Forget that plugins were loaded (the registries are left as they are)."""
    global _state, _report, _fatal
    with _lock:
        _state, _report, _fatal = "new", None, None


def _norm(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def _entry_points() -> list[Any]:
    # The standard library's, not the importlib-metadata backport: same API on 3.10+, and
    # reading each distribution's version is several times faster.
    import importlib.metadata as metadata

    return sorted(metadata.entry_points(group=GROUP), key=lambda ep: (ep.name, ep.value))


def _load_all(report: PluginReport) -> None:
    allow = report.allowlist
    wanted = None if allow is None else {_norm(n) for n in allow}
    seen: set[str] = set()
    for ep in _entry_points():
        dist = getattr(ep, "dist", None)
        status = PluginStatus(
            name=ep.name, value=ep.value,
            dist=getattr(dist, "name", None), version=getattr(dist, "version", None),
        )
        report.plugins.append(status)
        keys = {_norm(ep.name)} | ({_norm(status.dist)} if status.dist else set())
        seen |= keys
        if wanted is not None and not keys & wanted:
            status.status = SKIPPED
            continue
        _load_one(ep, status, report.strict)
        if status.status == FAILED and report.strict:
            raise PluginLoadError(
                f"ember plugin {status.name!r} ({status.provider}) failed to load "
                f"(EMBER_PLUGINS_STRICT=1): {status.error}\n{status.traceback}"
            )
    for name in sorted((wanted or set()) - seen):
        report.plugins.append(PluginStatus(name=name, status=MISSING,
                                           error="named in EMBER_PLUGINS but not installed"))
        _logger().warning("EMBER_PLUGINS names %r, but no installed plugin has that name", name)
        if report.strict:
            raise PluginLoadError(f"EMBER_PLUGINS names {name!r}, which is not installed "
                                  "(EMBER_PLUGINS_STRICT=1)")


def _load_one(ep: Any, status: PluginStatus, strict: bool = False) -> None:
    from ember.registry import REGISTRIES, load_state, registering_as, save_state

    saved = save_state()
    had_torch = "torch" in sys.modules
    try:
        with registering_as(status.dist or ep.name, status.version, ep.name):
            obj = ep.load()
            if isinstance(obj, types.FunctionType):
                obj()  # vLLM-style: a register() function that registers by side effect
            else:
                _run_hooks(obj, status)
    except Exception as exc:  # a plugin must never take ember down (unless strict)
        load_state(saved)
        status.status = FAILED
        status.error = f"{type(exc).__name__}: {exc}"
        import traceback

        status.traceback = traceback.format_exc()
        log = _logger()
        if strict:  # the caller raises PluginLoadError next: say so, not "disabled"
            log.error("ember plugin %r (%s, %s) failed to load: %s; EMBER_PLUGINS_STRICT=1 makes "
                      "this fatal", status.name, status.provider, status.value, status.error)
        else:
            log.error(
                "ember plugin %r (%s, %s) failed to load and is disabled; the other plugins and "
                "the built-ins are unaffected (`ember plugins -v` shows its traceback; "
                "EMBER_PLUGINS_STRICT=1 makes it fatal): %s", status.name, status.provider,
                status.value, status.error,
            )
        log.debug("traceback of ember plugin %r:\n%s", status.name, status.traceback)
        return
    status.status = LOADED
    if not had_torch and "torch" in sys.modules:
        status.warnings.append("importing its registration module imported torch, which makes "
                               "`ember plugins` and start-up slow: import it where it is used")
    status.registered = [
        f"{kind}:{entry.name}"
        for kind, reg in REGISTRIES.items()
        for entry in reg._entries.values()
        if entry.plugin == ep.name and entry.owner == (status.dist or ep.name)
    ]
    for warning in status.warnings:
        _logger().warning("ember plugin %r: %s", status.name, warning)


def _run_hooks(obj: Any, status: PluginStatus) -> None:
    import pluggy

    from ember.plugins import hookspecs
    from ember.registry import REGISTRIES

    if isinstance(obj, type):
        obj = obj()
    # One manager per plugin: pluggy validates each hookimpl's arguments against the specs.
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    pm.register(obj, name=status.name)
    callers = pm.get_hookcallers(obj) or []
    known = set(hookspecs.HOOKS)
    for caller in callers:
        if caller.name not in known:
            status.warnings.append(
                f"implements {caller.name!r}, which this ember (plugin API "
                f"v{hookspecs.PLUGIN_API_VERSION}) does not define; it is ignored"
            )
    if not callers:
        status.warnings.append("implements no ember hook (is @hookimpl missing?)")
    for hook_name, kind in hookspecs.HOOKS.items():
        args = {"registry": REGISTRIES[kind], "api_version": hookspecs.PLUGIN_API_VERSION}
        for impl in getattr(pm.hook, hook_name).get_hookimpls():
            if impl.wrapper or impl.hookwrapper:
                raise TypeError(f"{hook_name}: wrapper hookimpls are not supported")
            impl.function(**{name: args[name] for name in impl.argnames})


hooks.add_before_read(load_plugins)
hooks.add_snapshot_section("plugins", _export_report, _adopt_report_data)
