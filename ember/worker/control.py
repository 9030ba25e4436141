"""Engine control on the worker: sleep / wake_up and collective_rpc (vLLM's names).

Sleep level 1 drops the KV cache and moves the weights to host memory (page-locked where the
platform pins); level 2 drops the weights too, and wake_up reloads them from the checkpoint.
Decode graphs hold the addresses of both, so they are released on sleep and captured again once
both are back. Every device operation goes through the Platform (host buffers, synchronize,
empty_cache), so on a GPU the memory really returns to the device; on the CPU, where weights
already live in host memory, level 1 keeps them where they are.

Weights are every parameter and buffer of the model and a quantized layer's `state` (a tuple of
tensors that are neither); each is swapped in place (`param.data`, the buffer slot, the
attribute), so every module keeps its identity and a compiled model its guards.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._pytree import tree_map

if TYPE_CHECKING:
    from ember.config import EngineArgs
    from ember.worker.model_runner import ModelRunner

logger = logging.getLogger("ember")

KV_CACHE, WEIGHTS = "kv_cache", "weights"


def _model(runner: ModelRunner) -> torch.nn.Module:
    return getattr(runner.model, "_orig_mod", runner.model)  # through torch.compile's wrapper


def _slots(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module, str, str]]:
    """(module name, module, kind, attribute) of every weight tensor slot."""
    for name, module in model.named_modules():
        for attr, value in module._parameters.items():
            if value is not None:
                yield name, module, "param", attr
        for attr, value in module._buffers.items():
            if value is not None:
                yield name, module, "buffer", attr
        if isinstance(getattr(module, "state", None), (tuple, list, torch.Tensor)):
            yield name, module, "state", "state"


def _get(module: torch.nn.Module, kind: str, attr: str) -> Any:
    if kind == "param":
        return module._parameters[attr].data
    if kind == "buffer":
        return module._buffers[attr]
    return getattr(module, attr)


def _set(module: torch.nn.Module, kind: str, attr: str, value: Any) -> None:
    if kind == "param":
        module._parameters[attr].data = value
    elif kind == "buffer":
        module._buffers[attr] = value
    else:
        setattr(module, attr, value)


def _map_weights(model: torch.nn.Module, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
    seen: set[int] = set()  # a tied weight is one Parameter reached twice: move it once
    for _, module, kind, attr in _slots(model):
        key = id(module._parameters[attr]) if kind == "param" else id(module) ^ hash(attr)
        if key in seen:
            continue
        seen.add(key)
        value = _get(module, kind, attr)
        _set(module, kind, attr, tree_map(lambda t: fn(t) if isinstance(t, torch.Tensor) else t,
                                          value))


class WorkerControl:
    """Sleep state and RPC dispatch for one ModelRunner."""

    def __init__(self, runner: ModelRunner, args: EngineArgs, num_blocks: int) -> None:
        self.runner = runner
        self.args = args
        self.num_blocks = num_blocks
        self.level = 0  # 0 awake, else the level it sleeps at
        self.asleep: set[str] = set()  # what is gone: KV_CACHE, WEIGHTS
        self.graph_batch_size: int | None = None  # graphs to capture again on wake-up

    # ---- sleep ---------------------------------------------------------------------------
    def sleep(self, level: int = 1) -> None:
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
        if self.level:
            raise RuntimeError(f"the engine already sleeps (level {self.level}): wake_up first")
        runner, platform = self.runner, self.runner.platform
        platform.synchronize()
        if runner.graph_runner is not None:
            self.graph_batch_size = runner.graph_runner.max_batch_size
            runner.graph_runner = None  # its graphs point at the memory freed below
        runner.kv_caches = []
        runner.in_flight = None  # no request runs (the core checks), so nothing reads it
        if level == 1:
            if not platform.device_is_host():
                _map_weights(_model(runner), self._to_host)
        else:
            _map_weights(_model(runner), lambda t: torch.empty(0, dtype=t.dtype, device=t.device))
        platform.empty_cache()
        self.level, self.asleep = level, {KV_CACHE, WEIGHTS}
        logger.info("engine asleep (level %d): KV cache dropped, weights %s", level,
                    "moved to host memory" if level == 1 else "dropped")

    def _to_host(self, t: torch.Tensor) -> torch.Tensor:
        host = self.runner.platform.empty_host_buffer(t.numel(), t.dtype).view(t.shape)
        host.copy_(t, non_blocking=True)
        return host

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Bring back what `tags` names (both when None): weights first, then the KV cache."""
        tags = [WEIGHTS, KV_CACHE] if tags is None else list(tags)
        unknown = set(tags) - {WEIGHTS, KV_CACHE}
        if unknown:
            raise ValueError(f"unknown wake_up tags {sorted(unknown)}; valid: weights, kv_cache")
        runner, platform = self.runner, self.runner.platform
        if WEIGHTS in tags and WEIGHTS in self.asleep:
            if self.level == 1:
                device = runner.device
                _map_weights(_model(runner), lambda t: t.to(device, non_blocking=True))
            else:
                self._reload_weights()
            platform.synchronize()  # the host copies may go once the device has them
            self.asleep.discard(WEIGHTS)
        if KV_CACHE in tags and KV_CACHE in self.asleep:
            runner.initialize_kv_cache(self.num_blocks)
            self.asleep.discard(KV_CACHE)
        if not self.asleep:
            if self.graph_batch_size is not None:
                runner.capture_graphs(self.graph_batch_size)
                self.graph_batch_size = None
            self.level = 0
            logger.info("engine awake")

    def _reload_weights(self) -> None:
        """Build the model again from the checkpoint (quantization included) and move its
        tensors into this model's slots, one at a time, so the peak is one model's weights."""
        from ember.worker.builder import build_model

        runner = self.runner
        fresh = build_model(self.args, runner.platform, runner.model_config,
                            runner.attn_backend, runner.dtype)
        modules = dict(fresh.named_modules())
        for name, module, kind, attr in _slots(_model(runner)):
            source = modules.get(name)
            if source is None:
                raise RuntimeError(f"reloaded model has no module {name!r}")
            _set(module, kind, attr, _get(source, kind, attr))
        del fresh, modules

    # ---- RPC -----------------------------------------------------------------------------
    def collective_rpc(self, method: str | Callable[..., Any], args: tuple = (),
                       kwargs: dict[str, Any] | None = None) -> list[Any]:
        """vLLM's: a callable runs as `method(worker, *args, **kwargs)`, a string names a
        method of the worker (the ModelRunner; `apply_model` is this object's). One result per
        worker: a list of one here."""
        kwargs = kwargs or {}
        if callable(method):
            return [method(self.runner, *args, **kwargs)]
        if not isinstance(method, str) or method.startswith("_"):
            raise ValueError(f"collective_rpc: {method!r} is not a worker method")
        target = getattr(self, method, None) if method in ("apply_model",) else None
        if target is None:
            target = getattr(self.runner, method, None)
        if not callable(target):
            raise ValueError(f"collective_rpc: the worker has no method {method!r}")
        return [target(*args, **kwargs)]

    def apply_model(self, func: Callable[[torch.nn.Module], Any]) -> Any:
        """func(model) on this worker (the model as built, not a compiled wrapper)."""
        return func(_model(self.runner))
