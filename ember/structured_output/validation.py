"""The front end's check of a request's structured outputs: the constraint is well formed and the
engine's grammar backend can compile it (else a ValueError naming the problem, which the server
turns into a 400), and the backend that will compile it is recorded in the params.

Backend "auto" (vLLM's): xgrammar when it can enforce the constraint, else guidance.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from ember.sampling_params import SamplingParams
from ember.structured_output.config import StructuredOutputsConfig
from ember.structured_output.interface import GrammarSpec, StructuredOutputBackend

AUTO_ORDER = ("xgrammar", "guidance")
_checked: OrderedDict[tuple, str] = OrderedDict()  # (backend setting, spec key) -> backend
_checked_lock = threading.Lock()
_CHECKED_SIZE = 1024


def resolve_backend_class(name: str) -> type[StructuredOutputBackend]:
    """The class registered under `name` (imports it); a TypeError if it is no backend."""
    from ember.registry import GrammarBackendRegistry

    cls = GrammarBackendRegistry.resolve(name)
    if not (isinstance(cls, type) and issubclass(cls, StructuredOutputBackend)):
        raise TypeError(f"grammar backend {name!r} resolves to {cls!r}, which is not a subclass "
                        "of ember.structured_output.interface.StructuredOutputBackend")
    return cls


def select_backend(spec: GrammarSpec, setting: str) -> str:
    """The backend that compiles `spec` under the engine's `setting`; ValueError if none can."""
    key = (setting, spec.key)
    with _checked_lock:
        found = _checked.get(key)
    if found is not None:
        return found
    if setting != "auto":
        resolve_backend_class(setting).validate(spec)
        found = setting
    else:
        errors = []
        for name in AUTO_ORDER:
            try:
                resolve_backend_class(name).validate(spec)
            except ValueError as exc:
                errors.append(str(exc))
                continue
            found = name
            break
        if found is None:
            raise ValueError("; ".join(dict.fromkeys(errors)))
    with _checked_lock:
        _checked[key] = found
        while len(_checked) > _CHECKED_SIZE:
            _checked.popitem(last=False)
    return found


def validate_structured_outputs(params: SamplingParams, config: StructuredOutputsConfig | None,
                                tokenizer: object) -> None:
    """Check `params.structured_outputs` (if any) and record its backend in it."""
    so = params.structured_outputs
    if so is None:
        return
    if tokenizer is None:
        raise ValueError("structured outputs need a tokenizer (skip_tokenizer_init=True was set)")
    config = config or StructuredOutputsConfig()
    try:
        so._spec = spec = GrammarSpec.of(so, config)
        so._backend = select_backend(spec, config.backend)
    except ValueError as exc:
        raise ValueError(f"invalid structured_outputs ({so.kind}): {exc}") from None
