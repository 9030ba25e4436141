"""Functions that cross into the engine-core process: hf_overrides, collective_rpc, apply_model.

Plain pickle carries module-level functions by reference (the core process imports them); a
lambda or a local function needs cloudpickle, which carries it by value. Without cloudpickle
such a function is refused here with an error that says what to do, instead of a PicklingError
from deep inside multiprocessing or a dead core.
"""

from __future__ import annotations

import dataclasses
import pickle
from typing import Any


def dumps(obj: Any, what: str) -> bytes:
    """Pickle `obj` (cloudpickle when installed); ValueError naming `what` when it cannot be."""
    try:
        import cloudpickle
    except ImportError:
        cloudpickle = None
    try:
        if cloudpickle is not None:
            return cloudpickle.dumps(obj)
        return pickle.dumps(obj)
    except Exception as exc:
        hint = ("" if cloudpickle is not None else
                "; install cloudpickle to send lambdas and local functions, or use a "
                "module-level function")
        raise ValueError(f"{what} cannot be sent to the engine core process "
                         f"({type(exc).__name__}: {exc}){hint}") from exc


def loads(data: bytes) -> Any:
    return pickle.loads(data)


class PickledFunction:
    """A function carried by value: unpickled on first call in the receiving process."""

    def __init__(self, fn: Any, what: str) -> None:
        self.payload = dumps(fn, what)
        self.name = getattr(fn, "__qualname__", repr(fn))
        self._fn: Any = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._fn is None:
            self._fn = loads(self.payload)
        return self._fn(*args, **kwargs)

    def __getstate__(self) -> dict[str, Any]:
        return {"payload": self.payload, "name": self.name, "_fn": None}

    def __repr__(self) -> str:
        return f"<pickled function {self.name}>"


def portable_args(args: Any) -> Any:
    """EngineArgs whose function-valued fields (hf_overrides) survive the trip to a spawned
    core process: by reference when plain pickle can, else by value through cloudpickle."""
    changes = {}
    for f in dataclasses.fields(args):
        value = getattr(args, f.name)
        if not callable(value) or isinstance(value, PickledFunction):
            continue
        try:
            pickle.dumps(value)
        except Exception:
            changes[f.name] = PickledFunction(value, f"{f.name}={value!r}")
    return dataclasses.replace(args, **changes) if changes else args
