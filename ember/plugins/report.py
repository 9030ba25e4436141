"""The plugin load report: one status per discovered (or allow-listed) plugin, as plain data.

Statuses: "loaded"; "failed" (import error, invalid hook, conflicting registration or an
exception in a hook; `error` and `traceback` say what); "skipped" (not in EMBER_PLUGINS);
"missing" (named in EMBER_PLUGINS but not installed). Plain classes rather than dataclasses:
this module is imported on every registry lookup path, and dataclasses costs an `inspect` import.
"""

from __future__ import annotations

from typing import Any

LOADED, FAILED, SKIPPED, MISSING = "loaded", "failed", "skipped", "missing"


class PluginStatus:
    """What happened to one plugin (an entry point in the ``ember.plugins`` group)."""

    __slots__ = ("name", "dist", "version", "value", "status", "error", "traceback",
                 "registered", "warnings")

    def __init__(
        self,
        name: str,
        dist: str | None = None,  # the distribution that declares it
        version: str | None = None,
        value: str | None = None,  # the entry point's "module:attr" (or module)
        status: str = LOADED,
        error: str | None = None,  # one line: "ModuleNotFoundError: No module named 'x'"
        traceback: str | None = None,
        registered: list[str] | None = None,  # "models:GemmaForCausalLM", ...
        warnings: list[str] | None = None,
    ) -> None:
        self.name, self.dist, self.version, self.value = name, dist, version, value
        self.status, self.error, self.traceback = status, error, traceback
        self.registered = list(registered or [])
        self.warnings = list(warnings or [])

    @property
    def provider(self) -> str:
        if self.dist is None:
            return "?"
        return f"{self.dist} {self.version}" if self.version else self.dist

    def to_dict(self) -> dict[str, Any]:
        return {k: (list(v) if isinstance(v, list) else v)
                for k in self.__slots__ for v in [getattr(self, k)]}

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PluginStatus) and self.to_dict() == other.to_dict()

    def __repr__(self) -> str:
        return f"PluginStatus({self.name!r}, {self.provider}, {self.status})"


class PluginReport:
    """Every plugin's status, in load order; serialisable for worker processes."""

    def __init__(self, plugins: list[PluginStatus] | None = None,
                 allowlist: list[str] | None = None, strict: bool = False) -> None:
        self.plugins = list(plugins or [])
        self.allowlist = allowlist  # EMBER_PLUGINS as read, None when unset
        self.strict = strict

    def by_status(self, status: str) -> list[PluginStatus]:
        return [p for p in self.plugins if p.status == status]

    @property
    def loaded(self) -> list[PluginStatus]:
        return self.by_status(LOADED)

    @property
    def failed(self) -> list[PluginStatus]:
        return self.by_status(FAILED)

    @property
    def ok(self) -> bool:
        return not self.failed and not self.by_status(MISSING)

    def get(self, name: str) -> PluginStatus | None:
        return next((p for p in self.plugins if p.name == name), None)

    def to_dict(self) -> dict[str, Any]:
        return {"plugins": [p.to_dict() for p in self.plugins],
                "allowlist": None if self.allowlist is None else list(self.allowlist),
                "strict": self.strict}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PluginReport:
        return cls(plugins=[PluginStatus(**p) for p in data.get("plugins", [])],
                   allowlist=data.get("allowlist"), strict=bool(data.get("strict", False)))

    def summary(self) -> str:
        counts = {s: len(self.by_status(s)) for s in (LOADED, FAILED, SKIPPED, MISSING)}
        return ", ".join(f"{n} {s}" for s, n in counts.items() if n) or "no plugins installed"

    def __repr__(self) -> str:
        return f"PluginReport({self.summary()})"
