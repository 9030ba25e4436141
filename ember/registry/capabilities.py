"""Static capability schemas of registry entries, and dtype names without importing torch.

Capabilities are checked when an entry is registered, so a plugin with a typo fails at load time
(with its name on the error) instead of being silently never selected.
"""

from __future__ import annotations

from typing import Any

DTYPES = ("float32", "float16", "bfloat16")
_DTYPE_ALIASES = {
    "float32": "float32", "fp32": "float32", "float": "float32", "f32": "float32",
    "float16": "float16", "fp16": "float16", "half": "float16", "f16": "float16",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
}


def canonical_dtype(dtype: Any) -> str:
    """'bf16', 'torch.bfloat16' or torch.bfloat16 -> 'bfloat16' (no torch import needed)."""
    text = str(dtype).lower()
    text = text[len("torch."):] if text.startswith("torch.") else text
    if text not in _DTYPE_ALIASES:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {', '.join(DTYPES)}")
    return _DTYPE_ALIASES[text]


# name -> (type check, default); "required" marks keys without a default.
_REQUIRED = object()
ATTENTION_BACKEND_CAPS: dict[str, Any] = {
    "devices": _REQUIRED,  # device types or platform names the backend runs on
    "dtypes": _REQUIRED,  # model dtypes it computes in
    "head_sizes": "any",  # "any" or a list of ints
    "sliding_window": False,
    "cuda_graphs": False,  # safe to capture in a CUDA graph (see AttentionBackend hooks)
    "priority": 0,  # higher wins among backends the platform does not order
    "requires": [],  # importable modules it needs (checked with find_spec, no import)
    "env_devices": {},  # {"VAR=value": [devices]}: extra devices while an env var is set
    "kv_cache_dtypes": ["auto"],  # EngineArgs.kv_cache_dtype values it reads and writes
}


def backend_caps(raw: dict[str, Any]) -> dict[str, Any]:
    """Validated attention-backend capabilities with defaults filled in."""
    unknown = sorted(set(raw) - set(ATTENTION_BACKEND_CAPS))
    if unknown:
        raise ValueError(
            f"unknown attention-backend capabilities {unknown}; "
            f"known: {', '.join(ATTENTION_BACKEND_CAPS)}"
        )
    caps: dict[str, Any] = {}
    for key, default in ATTENTION_BACKEND_CAPS.items():
        if key not in raw:
            if default is _REQUIRED:
                raise ValueError(f"attention-backend capability {key!r} is required")
            caps[key] = default if not isinstance(default, (list, dict)) else type(default)(default)
            continue
        caps[key] = raw[key]
    if not _str_list(caps["devices"]) or not caps["devices"]:
        raise ValueError(f"'devices' must be a non-empty list of strings, got {caps['devices']!r}")
    caps["dtypes"] = [canonical_dtype(d) for d in _as_list(caps["dtypes"], "dtypes")]
    sizes = caps["head_sizes"]
    if sizes != "any" and not (
        isinstance(sizes, (list, tuple)) and all(isinstance(s, int) and s > 0 for s in sizes)
    ):
        raise ValueError(f"'head_sizes' must be 'any' or a list of positive ints, got {sizes!r}")
    for flag in ("sliding_window", "cuda_graphs"):
        if not isinstance(caps[flag], bool):
            raise ValueError(f"{flag!r} must be a bool, got {caps[flag]!r}")
    if not isinstance(caps["priority"], int) or isinstance(caps["priority"], bool):
        raise ValueError(f"'priority' must be an int, got {caps['priority']!r}")
    if not _str_list(caps["requires"]):
        raise ValueError(f"'requires' must be a list of module names, got {caps['requires']!r}")
    env = caps["env_devices"]
    if not isinstance(env, dict) or any(
        "=" not in k or not _str_list(v) for k, v in env.items()
    ):
        raise ValueError(f"'env_devices' must map 'VAR=value' to device lists, got {env!r}")
    if not _str_list(caps["kv_cache_dtypes"]) or "auto" not in caps["kv_cache_dtypes"]:
        raise ValueError("'kv_cache_dtypes' must be a list of kv_cache_dtype names holding "
                         f"'auto', got {caps['kv_cache_dtypes']!r}")
    return caps


def _as_list(value: Any, key: str) -> list[Any]:
    if not isinstance(value, (list, tuple)) or not value:
        raise ValueError(f"{key!r} must be a non-empty list, got {value!r}")
    return list(value)


def _str_list(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and all(isinstance(v, str) and v for v in value)


# Capabilities that a class may repeat as an attribute: registry kind -> [(capability, class
# attribute, the contract base class whose default does not count as a declaration)].
CLASS_ATTRIBUTES: dict[str, list[tuple[str, str, str]]] = {
    "attention backend": [
        ("cuda_graphs", "supports_cuda_graphs", "ember.attention_backends.base:AttentionBackend")],
    "platform": [("device_type", "device_type", "ember.platforms.base:Platform")],
}


def _declared(cls: type, attr: str, contract: str) -> tuple[bool, Any]:
    """Whether `cls` (or a base below the contract class) sets `attr` itself, and to what."""
    for klass in cls.__mro__:
        if f"{klass.__module__}:{klass.__qualname__}" == contract:
            break
        if attr in vars(klass):
            return True, vars(klass)[attr]
    return False, None


def check_class_attributes(kind: str, name: str, target: str, caps: dict[str, Any],
                           obj: Any) -> None:
    """The registration is the source of truth: a class attribute that repeats a capability
    must agree with it (ValueError otherwise), and one the class leaves at the contract's default
    is set from it, so code that reads the attribute sees what selection read."""
    if not isinstance(obj, type):
        return
    for cap, attr, contract in CLASS_ATTRIBUTES.get(kind, []):
        if cap not in caps:
            continue
        declared, value = _declared(obj, attr, contract)
        if not declared:
            setattr(obj, attr, caps[cap])
        elif value != caps[cap]:
            raise ValueError(
                f"{kind} {name!r}: its class {target} says {attr}={value!r}, but its registration "
                f"declares {cap}={caps[cap]!r}; ember selects by the registration, so make them "
                f"agree (or drop the class attribute)"
            )
