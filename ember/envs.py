"""Every EMBER_* environment variable, read in one place (lazily, so tests can set them)."""

from __future__ import annotations

import os


def _str(name: str, default: str | None = None) -> str | None:
    value = os.environ.get(name)
    return default if value is None or value == "" else value


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def plugins_allowlist() -> list[str] | None:
    """EMBER_PLUGINS: comma-separated plugins to load, by entry-point or distribution name
    (case, '-', '_' and '.' do not matter); unset = all, empty string = none."""
    value = os.environ.get("EMBER_PLUGINS")
    if value is None:
        return None
    return [name.strip() for name in value.split(",") if name.strip()]


def plugins_strict() -> bool:
    """EMBER_PLUGINS_STRICT=1: a plugin that fails to load (or an allow-listed one that is not
    installed) raises PluginLoadError instead of being reported and skipped."""
    return _flag("EMBER_PLUGINS_STRICT")


def platform() -> str | None:
    """EMBER_PLATFORM: force a platform by name, e.g. "cuda:1" (same as device=...)."""
    return _str("EMBER_PLATFORM")


def attention_backend() -> str | None:
    """EMBER_ATTENTION_BACKEND: force an attention backend by name (same as attention_backend=);
    one that cannot run the model is an error, never a silent fallback."""
    return _str("EMBER_ATTENTION_BACKEND")


def logging_level() -> str:
    """EMBER_LOGGING_LEVEL: the ember logger's level (default INFO)."""
    return _str("EMBER_LOGGING_LEVEL", "INFO") or "INFO"


def disable_progress_bars() -> bool:
    """EMBER_DISABLE_PROGRESS=1: no tqdm bars (weight loading, offline generate)."""
    return _flag("EMBER_DISABLE_PROGRESS")


def api_key() -> str | None:
    """EMBER_API_KEY: the key `ember serve` requires on /v1/* (same as --api-key)."""
    return _str("EMBER_API_KEY")


def step_timing() -> bool:
    """EMBER_STEP_TIMING=1: time each engine phase per step (see ember.core.step_timer)."""
    return _flag("EMBER_STEP_TIMING")


def engine_process() -> bool:
    """EMBER_ENGINE_PROCESS=1: offline `LLM` / `LLMEngine` run the engine core in a process of
    its own (the server always does); default in-process."""
    return _flag("EMBER_ENGINE_PROCESS")


def log_stats_interval() -> float:
    """EMBER_LOG_STATS_INTERVAL: seconds between the stats log lines an engine with
    disable_log_stats=False writes (default 10, as vLLM's VLLM_LOG_STATS_INTERVAL)."""
    value = _str("EMBER_LOG_STATS_INTERVAL")
    try:
        return float(value) if value is not None else 10.0
    except ValueError as exc:
        raise ValueError(f"EMBER_LOG_STATS_INTERVAL must be a number of seconds, got {value!r}") from exc


def server_dev_mode() -> bool:
    """EMBER_SERVER_DEV_MODE=1: `ember serve` adds /reset_prefix_cache, /sleep, /wake_up and
    /is_sleeping (vLLM's VLLM_SERVER_DEV_MODE): engine control for operators, not clients."""
    return _flag("EMBER_SERVER_DEV_MODE")


def grammar_threads() -> int | None:
    """EMBER_GRAMMAR_THREADS: threads that fill a step's structured-output bitmasks (default:
    the cores less one, at most 4)."""
    value = _str("EMBER_GRAMMAR_THREADS")
    if value is None:
        return None
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"EMBER_GRAMMAR_THREADS must be a positive integer, got {value!r}")
    return int(value)


def grammar_process() -> bool | None:
    """EMBER_GRAMMAR_PROCESS: 1 keeps structured outputs' grammars in a process of their own
    (ember.structured_output.grammar_process), 0 on the engine core's threads; unset or "auto":
    a process where a step's sampling waits for its bitmask on a GPU (async scheduling with
    the runner in the engine's process)."""
    value = _str("EMBER_GRAMMAR_PROCESS")
    if value is None or value == "auto":
        return None
    if value not in ("0", "1"):
        raise ValueError(f"EMBER_GRAMMAR_PROCESS must be 0, 1 or auto, got {value!r}")
    return value == "1"


def grammar_deferred_accepts() -> bool:
    """EMBER_GRAMMAR_DEFERRED_ACCEPTS=1: under async scheduling the grammars advance on the
    bitmask helper thread, in one batched backend call, instead of a call a token on the engine
    thread (default off: measured slower on the H200, docs/benchmarks.md)."""
    return _flag("EMBER_GRAMMAR_DEFERRED_ACCEPTS")


def gc_freeze() -> bool:
    """EMBER_GC_FREEZE=0: keep start-up's objects in the garbage collector's full walks
    (ember.gc_heap; on by default)."""
    return _str("EMBER_GC_FREEZE", "1") != "0"


def cache_dir() -> str | None:
    """EMBER_CACHE_DIR: where ember keeps what it derives from a model file to load it faster
    the next time (a GGUF file's converted tokenizer, and its model as the gguf method packed it
    for the CPU, ~200 MB for the default model, 4 GiB at most) and the native CPU kernel it
    builds; default $XDG_CACHE_HOME/ember or ~/.cache/ember. Set it to "off" to keep nothing on
    disk (the kernel is then built in a temporary directory)."""
    value = os.environ.get("EMBER_CACHE_DIR")
    if value is not None and value.strip().lower() in ("off", "0", "none", "false"):
        return None
    if value:
        return value
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "ember")
