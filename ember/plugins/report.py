"""The plugin load report: one status per discovered (or allow-listed) plugin, as plain data.

Statuses: "loaded"; "failed" (import error, invalid hook, conflicting registration or an
exception in a hook; `error` and `traceback` say what); "skipped" (not in EMBER_PLUGINS);
"missing" (named in EMBER_PLUGINS but not installed).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

LOADED, FAILED, SKIPPED, MISSING = "loaded", "failed", "skipped", "missing"


@dataclass
class PluginStatus:
    """What happened to one plugin (an entry point in the ``ember.plugins`` group)."""

    name: str  # the entry point's name
    dist: str | None = None  # the distribution that declares it
    version: str | None = None
    value: str | None = None  # the entry point's "module:attr" (or module)
    status: str = LOADED
    error: str | None = None  # one line: "ModuleNotFoundError: No module named 'x'"
    traceback: str | None = None
    registered: list[str] = field(default_factory=list)  # "models:Phi3ForCausalLM", ...
    warnings: list[str] = field(default_factory=list)

    @property
    def provider(self) -> str:
        if self.dist is None:
            return "?"
        return f"{self.dist} {self.version}" if self.version else self.dist


@dataclass
class PluginReport:
    """Every plugin's status, in load order; serialisable for worker processes."""

    plugins: list[PluginStatus] = field(default_factory=list)
    allowlist: list[str] | None = None  # EMBER_PLUGINS as read, None when unset
    strict: bool = False

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
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PluginReport:
        return cls(
            plugins=[PluginStatus(**p) for p in data.get("plugins", [])],
            allowlist=data.get("allowlist"),
            strict=bool(data.get("strict", False)),
        )

    def summary(self) -> str:
        counts = {s: len(self.by_status(s)) for s in (LOADED, FAILED, SKIPPED, MISSING)}
        return ", ".join(f"{n} {s}" for s, n in counts.items() if n) or "no plugins installed"
