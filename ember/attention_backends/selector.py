"""Attention-backend selection by declared capability, and its explanation.

Candidates are every registered backend, in this order: the platform's
`preferred_attention_backends` first (in its order), then the others by descending "priority"
(then name). The first whose static capabilities fit wins: device (the platform's device type or
name), dtype, head size, sliding window, CUDA graphs, KV-cache dtype ("kv_cache_dtypes": fp8
caches), and required modules being installed (checked with find_spec, nothing imported). A
user override (`override=` / EMBER_ATTENTION_BACKEND) skips the ranking, and fails with the
reason when the backend does not fit; nothing falls back silently. Only the chosen backend's
module is imported.
"""

from __future__ import annotations

import importlib.util
import os
from typing import TYPE_CHECKING, Any

from ember import envs
from ember.registry.capabilities import canonical_dtype

if TYPE_CHECKING:
    from ember.attention_backends.base import AttentionBackend
    from ember.platforms.base import Platform
    from ember.registry.base import Entry


def _devices(caps: dict[str, Any]) -> list[str]:
    devices = list(caps.get("devices", []))
    for condition, extra in caps.get("env_devices", {}).items():
        var, _, value = condition.partition("=")
        if os.environ.get(var) == value:
            devices += extra
    return devices


def _module_missing(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is None
    except (ImportError, ValueError):
        return True


def rejection(entry: Entry, platform: Platform, *, dtype: str, head_size: int,
              sliding_window: bool, need_cuda_graphs: bool,
              kv_cache_dtype: str = "auto") -> str | None:
    """Why `entry` cannot run this model on `platform`, or None when it can."""
    caps = entry.capabilities
    devices = _devices(caps)
    if platform.name not in devices and platform.device_type not in devices:
        return f"runs on {devices}, not on {platform.name} ({platform.device_type})"
    if dtype not in caps.get("dtypes", []):
        return f"dtype {dtype} not supported (supports {caps.get('dtypes')})"
    sizes = caps.get("head_sizes", "any")
    if sizes != "any" and head_size not in sizes:
        return f"head size {head_size} not supported (supports {sizes})"
    if sliding_window and not caps.get("sliding_window", False):
        return "the model uses a sliding window, which it does not support"
    if need_cuda_graphs and not caps.get("cuda_graphs", False):
        return "CUDA graphs are needed, and it is not graph-safe"
    if kv_cache_dtype not in caps.get("kv_cache_dtypes", ["auto"]):
        return (f"kv_cache_dtype={kv_cache_dtype!r} not supported (supports "
                f"{caps.get('kv_cache_dtypes', ['auto'])})")
    missing = [m for m in caps.get("requires", []) if _module_missing(m)]
    if missing:
        return f"needs {', '.join(missing)}, not installed"
    return None


def rank_attention_backends(
    platform: Platform,
    *,
    dtype: str,
    head_size: int,
    sliding_window: bool = False,
    need_cuda_graphs: bool = False,
    override: str | None = None,
    kv_cache_dtype: str = "auto",
) -> tuple[str, list[str]]:
    """The chosen backend's name and one line per candidate saying why (imports nothing)."""
    from ember.registry import AttentionBackendRegistry as registry

    dtype = canonical_dtype(dtype)
    want = dict(dtype=dtype, head_size=head_size, sliding_window=sliding_window,
                need_cuda_graphs=need_cuda_graphs, kv_cache_dtype=kv_cache_dtype)
    lines = [f"model needs: dtype {dtype}, head size {head_size}"
             + (", sliding window" if sliding_window else "")
             + (", CUDA graphs" if need_cuda_graphs else "")
             + (f", kv_cache_dtype {kv_cache_dtype}" if kv_cache_dtype != "auto" else "")]
    source = "override="
    if override is None and envs.attention_backend():
        override, source = envs.attention_backend(), "EMBER_ATTENTION_BACKEND="
    if override:
        if override not in registry:
            raise ValueError(f"unknown attention backend {override!r} (from {source}); "
                             f"known: {', '.join(registry.names())}")
        entry = registry.entry(override)
        reason = rejection(entry, platform, **want)
        if reason:
            raise ValueError(f"attention backend {override!r} (from {source}{override!r}, "
                             f"{entry.provider}) cannot be used on platform {platform.name}: "
                             f"{reason}")
        lines.append(f"{override}: chosen, because {source}{override!r}")
        return override, lines

    preferred = list(platform.preferred_attention_backends)
    lines.append(f"platform {platform.name} prefers: {', '.join(preferred) or '(nothing)'}; "
                 "then the other backends by priority")
    rest = sorted((e for e in registry.entries() if e.name not in preferred),
                  key=lambda e: (-int(e.capabilities.get("priority", 0)), e.name))
    chosen: str | None = None
    for name in preferred:
        if name not in registry:
            lines.append(f"{name}: skipped, preferred by {platform.name} but not registered")
            continue
        chosen = _consider(registry.entry(name), platform, want, chosen, lines,
                           f"#{preferred.index(name) + 1} in {platform.name}'s preference")
    for entry in rest:
        chosen = _consider(entry, platform, want, chosen, lines,
                           f"priority {entry.capabilities.get('priority', 0)}")
    if chosen is None:
        raise ValueError(f"no attention backend can run this model on platform "
                         f"{platform.name}:\n  " + "\n  ".join(lines))
    return chosen, lines


def _consider(entry: Entry, platform: Platform, want: dict[str, Any], chosen: str | None,
              lines: list[str], rank: str) -> str | None:
    reason = rejection(entry, platform, **want)
    who = "" if entry.builtin else f" [{entry.provider}]"
    if reason:
        lines.append(f"{entry.name}{who}: rejected, {reason}")
        return chosen
    if chosen is None:
        lines.append(f"{entry.name}{who}: chosen ({rank})")
        return entry.name
    lines.append(f"{entry.name}{who}: suitable, but {chosen} comes first ({rank})")
    return chosen


def select_attention_backend(
    platform: Platform,
    *,
    dtype: str,
    head_size: int,
    sliding_window: bool = False,
    need_cuda_graphs: bool = False,
    override: str | None = None,
    kv_cache_dtype: str = "auto",
) -> type[AttentionBackend]:
    """The AttentionBackend class to use (see the module docstring for the rules)."""
    from ember.registry import AttentionBackendRegistry

    name, _ = rank_attention_backends(
        platform, dtype=dtype, head_size=head_size, sliding_window=sliding_window,
        need_cuda_graphs=need_cuda_graphs, override=override, kv_cache_dtype=kv_cache_dtype,
    )
    return AttentionBackendRegistry.resolve(name)


def explain_attention_backend(
    platform: Platform,
    *,
    dtype: str,
    head_size: int,
    sliding_window: bool = False,
    need_cuda_graphs: bool = False,
    override: str | None = None,
    kv_cache_dtype: str = "auto",
) -> list[str]:
    """Why select_attention_backend would pick what it picks, one line per candidate."""
    try:
        return rank_attention_backends(
            platform, dtype=dtype, head_size=head_size, sliding_window=sliding_window,
            need_cuda_graphs=need_cuda_graphs, override=override, kv_cache_dtype=kv_cache_dtype,
        )[1]
    except ValueError as exc:
        return [f"error: {exc}"]
