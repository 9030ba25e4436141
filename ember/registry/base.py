"""One generic lazy registry: name -> "module:attr" plus static capability data.

Listing or validating a registry never imports plugin code; `resolve` imports only the chosen
entry. Every registry is open: any string is a valid name. Each entry remembers who registered it
(the distribution and version of the plugin, "ember" for built-ins, "user" for user code), so that
`ember plugins` can show it and a conflicting registration can name both owners.

Registering a name that exists is an error unless `override=True` (vLLM lets the last write win
silently). Re-registering the same target by the same owner is a no-op, so re-running a notebook
cell works.

The registration's capability data is the source of truth. A registry kind may also check an
imported object against it (`check_resolved`), so a class attribute that repeats a capability
cannot silently disagree with what selection read.

Before any read or write a registry runs ember.registry.hooks.run_before_read(): that is where the
plugin loader, which this module knows nothing of, loads the installed plugins once.
"""

from __future__ import annotations

import importlib
import sys
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, ClassVar, Generic, TypeVar

from ember.registry import hooks

T = TypeVar("T")

# Who is registering right now: set by the plugin loader around each plugin's import and hooks,
# so a plugin's registrations are attributed to its distribution without the plugin saying so.
_current_owner: ContextVar[tuple[str, str | None, str | None] | None] = ContextVar(
    "ember_registry_owner", default=None
)


@contextmanager
def registering_as(
    owner: str, version: str | None = None, plugin: str | None = None
) -> Iterator[None]:
    """Attribute every registration made inside the block to `owner` (a distribution name)."""
    token = _current_owner.set((owner, version, plugin))
    try:
        yield
    finally:
        _current_owner.reset(token)


def _check_static(value: Any, where: str) -> None:
    """Capability data must be plain JSON-like data: it is listed, shown and sent to workers."""
    if value is None or isinstance(value, (str, int, float, bool)):
        return
    if isinstance(value, (list, tuple)):
        for item in value:
            _check_static(item, where)
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise ValueError(f"{where}: capability keys must be strings, got {key!r}")
            _check_static(item, where)
        return
    raise ValueError(
        f"{where}: capability values must be JSON-like data, got {type(value).__name__}"
    )


def _plain(value: Any) -> Any:
    """Tuples become lists, so a snapshot compares equal after a JSON round trip."""
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


class Entry:
    """A registration: where the object lives, who registered it, and what it declares."""

    __slots__ = ("name", "target", "owner", "version", "plugin", "capabilities", "overrides",
                 "unimportable")

    def __init__(
        self,
        name: str,
        target: str,
        owner: str = "ember",
        capabilities: dict[str, Any] | None = None,
        *,
        version: str | None = None,
        plugin: str | None = None,
        overrides: str | None = None,
        unimportable: str | None = None,
    ) -> None:
        self.name = name
        self.target = target  # "package.module:Attr"
        self.owner = owner  # distribution name, "ember" (built-in) or "user"
        self.version = version  # the owner's version, when it is a distribution
        self.plugin = plugin  # the entry point that registered it, if any
        self.capabilities = _plain(dict(capabilities or {}))
        self.overrides = overrides  # "owner version" of the entry this one replaced
        self.unimportable = unimportable  # why a worker process could not import it, if so

    @property
    def provider(self) -> str:
        return f"{self.owner} {self.version}" if self.version else self.owner

    @property
    def builtin(self) -> bool:
        return self.owner == "ember"

    def to_dict(self) -> dict[str, Any]:
        return {slot: getattr(self, slot) for slot in self.__slots__}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Entry:
        return cls(
            data["name"], data["target"], data.get("owner", "ember"), data.get("capabilities"),
            version=data.get("version"), plugin=data.get("plugin"),
            overrides=data.get("overrides"), unimportable=data.get("unimportable"),
        )

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Entry) and self.to_dict() == other.to_dict()

    def __repr__(self) -> str:
        return f"Entry({self.name!r} -> {self.target!r}, by {self.provider})"


def _target_of(obj: Any) -> str:
    module = getattr(obj, "__module__", None)
    qualname = getattr(obj, "__qualname__", None)
    if not module or not qualname:
        raise TypeError(f"cannot register {obj!r}: it has no __module__/__qualname__")
    if module == "__main__":
        # `python -m pkg.mod` runs pkg.mod as __main__; its real name is importable elsewhere.
        spec = getattr(sys.modules.get("__main__"), "__spec__", None)
        if spec is not None and getattr(spec, "name", None):
            module = spec.name
    return f"{module}:{qualname}"


class LazyRegistry(Generic[T]):
    """Maps names to lazily imported objects; errors list the valid names.

    Every lookup or registration first runs ember.registry.hooks.run_before_read() (ember loads
    the installed plugins there once, so built-ins come first, then plugins, then user code).
    """

    # Deprecated: assign through ember.registry.hooks.add_before_read(fn) instead. A callable
    # assigned here still runs before every read, with a DeprecationWarning the first time.
    before_read: ClassVar[Callable[[], None] | None] = None
    _before_read_warned: ClassVar[bool] = False

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, Entry] = {}
        self._resolved: dict[str, T] = {}

    # ---- registration ---------------------------------------------------------------------
    def register(
        self,
        name: str,
        target: str | T,
        *,
        owner: str | None = None,
        capabilities: dict[str, Any] | None = None,
        override: bool = False,
    ) -> Entry:
        """Register `target` ("module:attr", or the object itself) under `name`."""
        self._before_read()
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.kind} name must be a non-empty string, got {name!r}")
        version = plugin = None
        context = _current_owner.get()
        if context is not None:  # inside a plugin: the loader knows better than the plugin
            owner, version, plugin = context
        owner = owner or "user"
        if isinstance(target, str):
            module, sep, attr = target.partition(":")
            if not sep or not module or not attr:
                raise ValueError(f"{self.kind} target must look like 'module:attr', got {target!r}")
            path, obj = target, None
        else:
            path, obj = _target_of(target), target
        caps = dict(capabilities or {})
        _check_static(caps, f"{self.kind} {name!r}")
        try:
            caps = self.normalize_capabilities(caps)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{self.kind} {name!r}: {exc}") from None
        old = self._entries.get(name)
        if old is not None and not override and not (old.owner == owner and old.target == path):
            raise ValueError(
                f"{self.kind} {name!r} is already registered by {old.provider} ({old.target}); "
                f"{owner}{' ' + version if version else ''} cannot register it again "
                f"({path}) without override=True"
            )
        overrides = None
        if old is not None and old.owner != owner:
            overrides = old.provider
            import logging  # here, not at module level: the registry must import fast

            logging.getLogger("ember.registry").info(
                "%s %r of %s is overridden by %s", self.kind, name, old.provider, owner)
        entry = Entry(name, path, owner, caps, version=version, plugin=plugin, overrides=overrides)
        if obj is not None:
            self.check_resolved(entry, obj)
        self._entries[name] = entry
        self._resolved.pop(name, None)
        if obj is not None:
            self._resolved[name] = obj
        return entry

    def normalize_capabilities(self, caps: dict[str, Any]) -> dict[str, Any]:
        """Subclasses check their kind's capability schema here and fill in defaults."""
        return caps

    def check_resolved(self, entry: Entry, obj: Any) -> None:
        """Subclasses check an imported (or registered) object against its entry's declared
        capabilities here; raise ValueError on a disagreement."""

    # ---- lookup -------------------------------------------------------------------------
    def _before_read(self) -> None:
        hooks.run_before_read()
        legacy = LazyRegistry.__dict__.get("before_read")
        if legacy is not None:
            if not LazyRegistry._before_read_warned:
                LazyRegistry._before_read_warned = True
                warnings.warn("LazyRegistry.before_read is deprecated: use "
                              "ember.registry.hooks.add_before_read(fn)", DeprecationWarning,
                              stacklevel=3)
            legacy()

    def names(self) -> list[str]:
        self._before_read()
        return sorted(self._entries)

    def entries(self) -> list[Entry]:
        self._before_read()
        return [self._entries[n] for n in sorted(self._entries)]

    def entry(self, name: str) -> Entry:
        self._before_read()
        if name not in self._entries:
            raise ValueError(f"unknown {self.kind} {name!r}; known: {', '.join(self.names())}")
        return self._entries[name]

    def __contains__(self, name: object) -> bool:
        self._before_read()
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        self._before_read()
        return len(self._entries)

    def is_resolved(self, name: str) -> bool:
        """Whether `name` was imported (or registered as an object) in this process."""
        return name in self._resolved

    def resolve(self, name: str) -> T:
        """Import (once) and return the object registered under `name`."""
        entry = self.entry(name)
        if name in self._resolved:
            return self._resolved[name]
        if entry.unimportable:
            raise ImportError(
                f"{self.kind} {name!r} ({entry.target}, registered by {entry.provider}) cannot be "
                f"imported in this process: {entry.unimportable}"
            )
        module_name, _, attr = entry.target.partition(":")
        try:
            obj: Any = importlib.import_module(module_name)
            for part in attr.split("."):
                obj = getattr(obj, part)
        except (ImportError, AttributeError) as exc:
            hint = ""
            if module_name in ("__main__", "__mp_main__"):
                hint = (" (it was defined in the main script: define it at module level, outside "
                        "`if __name__ == '__main__':`, or better in an importable module)")
            raise ImportError(
                f"cannot import {self.kind} {name!r} from {entry.target} "
                f"(registered by {entry.provider}): {exc}{hint}"
            ) from exc
        self.check_resolved(entry, obj)
        self._resolved[name] = obj
        return obj

    # ---- hand-off to other processes ------------------------------------------------------
    def export_entries(self) -> list[dict[str, Any]]:
        """Entries as plain dicts; marks object registrations a worker could not import."""
        out = []
        for name in sorted(self._entries):
            data = self._entries[name].to_dict()
            if name in self._resolved and not data["unimportable"]:
                data["unimportable"] = _why_unimportable(data["target"], self._resolved[name])
            out.append(data)
        return out

    def import_entries(self, entries: list[dict[str, Any]]) -> None:
        """Replace this registry's table with exported entries (imports nothing)."""
        new = {data["name"]: Entry.from_dict(data) for data in entries}
        # Keep objects already imported here when their entry did not change.
        self._resolved = {
            n: obj for n, obj in self._resolved.items()
            if n in new and n in self._entries and self._entries[n].target == new[n].target
        }
        self._entries = new

    def _save(self) -> tuple[dict[str, Entry], dict[str, T]]:
        return dict(self._entries), dict(self._resolved)

    def _load(self, state: tuple[dict[str, Entry], dict[str, T]]) -> None:
        self._entries, self._resolved = dict(state[0]), dict(state[1])


def _why_unimportable(target: str, obj: Any) -> str | None:
    """Why another process could not import `obj` by its "module:qualname", or None."""
    module_name, _, qualname = target.partition(":")
    if "<locals>" in qualname:
        return "it is defined inside a function; define it at module level"
    module = sys.modules.get(module_name)
    if module_name == "__main__" and not getattr(module, "__file__", None):
        return ("it is defined in an interactive __main__ (REPL, notebook or `python -c`), which "
                "worker processes cannot import; define it in a module and register 'module:Class'")
    if module is None:
        return None
    found: Any = module
    for part in qualname.split("."):
        found = getattr(found, part, None)
    if found is not obj:
        return f"{target} does not lead back to the registered object"
    return None
