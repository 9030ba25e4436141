"""The quantization-method contract, how a method is selected, and how it reaches the model.

A method (registered by name in ``QuantizationRegistry``) declares what it supports as class
attributes (also given as registry capabilities, so ``ember plugins`` lists them without imports):
``platforms`` (device types), ``dtypes`` (model/activation dtypes), ``layer_kinds`` ("linear")
and ``checkpoint_formats`` (the checkpoint metadata it reads: an HF ``quantization_config``
``quant_method`` value, or "gguf"). It reaches the layers in one of two ways:

- Checkpoint path (pre-quantized weights: GGUF, AWQ, GPTQ, fp8): ``get_linear_method(layer,
  prefix)`` returns a ``LinearMethod`` (ember.layers.linear) that creates the layer's quantized
  parameters, loads them through the weight-loader metadata, post-processes them after load and
  applies them. ``from_checkpoint(path, hf_config)`` builds the method from the checkpoint's own
  metadata (group size, bits...).
- Post-load path (float weights quantized once loaded, e.g. int8): ``quantize`` / ``dequantize``
  / ``apply(state, ...)``; ``quantize_model`` swaps every eligible float linear layer for a
  ``QuantizedLinear`` after loading. ``ember.testing.check_quantization_method`` checks these
  three calls against each other.

``resolve_quantization`` picks the method from ``LLM(quantization=...)`` and the checkpoint's
metadata; any mismatch is a ValueError, never a silent float load.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from ember.layers.linear import Linear, LinearMethod

# quantization="none": load a quantized checkpoint's weights as floats (GGUF: dequantized).
NO_QUANTIZATION = "none"


class QuantizationMethod:
    name: ClassVar[str] = ""
    platforms: ClassVar[tuple[str, ...]] = ("cpu", "cuda")
    dtypes: ClassVar[tuple[str, ...]] = ("float32", "float16", "bfloat16")
    layer_kinds: ClassVar[tuple[str, ...]] = ("linear",)
    # Checkpoint metadata this method reads ("gguf", or HF quantization_config quant_method
    # values); empty: it quantizes float weights after loading.
    checkpoint_formats: ClassVar[tuple[str, ...]] = ()
    # True: it can also quantize a float checkpoint at load (e.g. fp8 from bf16).
    quantizes_float: ClassVar[bool] = True
    # Module names (suffixes) left in float: logits feed sampling and logprobs directly.
    skip_modules: ClassVar[tuple[str, ...]] = ("lm_head",)

    @classmethod
    def from_checkpoint(cls, path: str, hf_config: Any) -> QuantizationMethod:
        """The method configured from the checkpoint's metadata (default: no settings)."""
        return cls()

    def check_supported(self, device_type: str, dtype: torch.dtype) -> None:
        """ValueError naming what this method cannot run: the platform or the dtype."""
        dtype_name = str(dtype).removeprefix("torch.")
        if self.platforms and device_type not in self.platforms:
            raise ValueError(f"quantization {self.name!r} runs on {', '.join(self.platforms)}, "
                             f"not on {device_type!r}")
        if self.dtypes and dtype_name not in self.dtypes:
            raise ValueError(f"quantization {self.name!r} supports dtype "
                             f"{', '.join(self.dtypes)}, not {dtype_name}")

    # ---- checkpoint path -----------------------------------------------------------------------

    def get_linear_method(self, layer: Linear, prefix: str) -> LinearMethod | None:
        """The LinearMethod for a layer as it is built (None: this method quantizes after
        loading, or leaves the layer in float)."""
        return None

    def loading_context(self) -> contextlib.AbstractContextManager[Any]:
        """Entered while the checkpoint is read (e.g. GGUF: keep the raw blocks)."""
        return contextlib.nullcontext()

    def process_model_after_loading(self, model: nn.Module) -> None:
        """Model-wide work once every tensor is loaded (e.g. a quantized logits head)."""

    # A method whose post-load work is slow can offer it to ember.quantization.snapshot_cache:
    # ``snapshot_recipe`` describes what that work built (JSON-able; None: nothing to cache on
    # this device), ``restore_snapshot`` rebuilds those modules around the saved tensors of a
    # model built but not loaded. The cache then saves and loads every tensor of the model.

    def snapshot_recipe(self, model: nn.Module) -> dict[str, Any] | None:
        return None

    def restore_snapshot(self, model: nn.Module, recipe: dict[str, Any],
                         tensors: dict[str, torch.Tensor]) -> None:
        raise NotImplementedError

    def snapshot_variant(self, device: torch.device) -> str:
        """What else decides the snapshot's form on ``device`` (the kernel the layers will run
        on, say): part of the cache key, so machines that share a cache never trade entries."""
        return ""

    @property
    def offers_snapshots(self) -> bool:
        """Whether this method overrides ``snapshot_recipe`` (the cache skips the others)."""
        return type(self).snapshot_recipe is not QuantizationMethod.snapshot_recipe

    @property
    def loads_quantized(self) -> bool:
        return type(self).get_linear_method is not QuantizationMethod.get_linear_method

    # ---- post-load path ------------------------------------------------------------------------

    def quantize(self, weight: torch.Tensor) -> Any:
        raise NotImplementedError

    def dequantize(self, state: Any) -> torch.Tensor:
        raise NotImplementedError

    def apply(self, state: Any, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """Default: dequantize and multiply (methods override with a fused kernel)."""
        return F.linear(x, self.dequantize(state).to(x.dtype), bias)


class QuantizedLinear(nn.Module):
    """A linear layer computed by a quantization method from its stored weight state."""

    def __init__(self, method: QuantizationMethod, state: Any, bias: torch.Tensor | None,
                 in_features: int, out_features: int) -> None:
        super().__init__()
        self.method = method
        self.state = state
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.in_features, self.out_features = in_features, out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self.state, x, self.bias)

    # What the layers before a Linear ask of it (ember.layers.linear): its input as it is, no
    # weight to prefetch.
    def quantized_input_dtype(self, x: torch.Tensor) -> torch.dtype | None:
        return None

    def weights_to_prefetch(self, rows: int) -> list[torch.Tensor]:
        return []

    def extra_repr(self) -> str:
        return f"{self.method.name}, in={self.in_features}, out={self.out_features}"


def _float_linear(module: nn.Module) -> bool:
    from ember.layers.linear import Linear, UnquantizedLinearMethod

    if isinstance(module, Linear):
        return isinstance(module.quant_method, UnquantizedLinearMethod)
    return isinstance(module, nn.Linear)


def quantize_model(model: nn.Module, method: QuantizationMethod) -> int:
    """Post-load path: replace every eligible float linear layer of `model` in place; returns
    how many were replaced."""
    targets = [
        (name, module) for name, module in model.named_modules()
        if _float_linear(module) and not name.endswith(method.skip_modules)
    ]
    for name, linear in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        with torch.no_grad():
            state = method.quantize(linear.weight.detach())
        bias = None if linear.bias is None else linear.bias.detach()
        setattr(parent, child, QuantizedLinear(method, state, bias, linear.in_features,
                                               linear.out_features))
    return len(targets)


def linear_method_provider_for(method: QuantizationMethod | None):  # type: ignore[no-untyped-def]
    """The provider ``ember.layers.linear.linear_method_provider`` takes while a model is built:
    the method's LinearMethod for each layer outside ``skip_modules``."""

    def provider(layer: Linear, prefix: str) -> LinearMethod | None:
        if method is None or (prefix and prefix.endswith(method.skip_modules)):
            return None
        return method.get_linear_method(layer, prefix)

    return provider


# ---- selection -------------------------------------------------------------------------------


def checkpoint_quantization(hf_config: Any, is_gguf: bool) -> str | None:
    """The quantization format the checkpoint declares: "gguf", its quantization_config's
    quant_method, or None for float weights."""
    if is_gguf:
        return "gguf"
    qc = getattr(hf_config, "quantization_config", None)
    if not qc:
        return None
    method = qc.get("quant_method") if isinstance(qc, dict) else getattr(qc, "quant_method", None)
    method = getattr(method, "value", method)
    return str(method).lower() if method else "unknown"


def _methods_reading(fmt: str) -> list[str]:
    from ember.registry import QuantizationRegistry

    return [name for name in QuantizationRegistry.names()
            if fmt in QuantizationRegistry.entry(name).capabilities.get("checkpoint_formats", ())]


def resolve_quantization(requested: str | None, hf_config: Any, path: str,
                         is_gguf: bool) -> str | None:  # fmt: skip
    """The registry name of the method to use (None: float), from ``quantization=`` and the
    checkpoint's metadata. ValueError for every mismatch: a quantized checkpoint no method
    reads, a method asked for that cannot read the checkpoint's format, a load-time method on a
    quantized checkpoint, a checkpoint method on float weights it cannot quantize."""
    from ember.registry import QuantizationRegistry

    fmt = checkpoint_quantization(hf_config, is_gguf)
    if requested == "gguf" and not is_gguf:
        raise ValueError(f"quantization='gguf' needs a .gguf file, but {path!r} is an HF "
                         "directory; leave quantization unset for its float weights")
    if requested == NO_QUANTIZATION:
        if fmt is not None and fmt != "gguf":
            raise ValueError(f"quantization='none': {path!r} holds {fmt}-quantized weights, "
                             "which ember cannot turn back into floats")
        return None
    if requested is not None and requested not in QuantizationRegistry:
        raise ValueError(f"unknown quantization method {requested!r}; known: "
                         f"{', '.join([*QuantizationRegistry.names(), NO_QUANTIZATION])}")
    readers = _methods_reading(fmt) if fmt is not None else []
    if fmt is not None and not readers:
        raise ValueError(f"{path!r} holds {fmt}-quantized weights (its checkpoint metadata); no "
                         "registered quantization method reads them (known: "
                         f"{', '.join(QuantizationRegistry.names())})")
    if requested is None:
        return readers[0] if readers else None
    caps = QuantizationRegistry.entry(requested).capabilities
    if fmt is None:
        if caps.get("checkpoint_formats") and not caps.get("quantizes_float", False):
            raise ValueError(f"quantization={requested!r} loads {requested} checkpoints, but "
                             f"{path!r} holds float weights")
        return requested
    if requested not in readers:
        raise ValueError(f"quantization={requested!r}, but {path!r} holds {fmt}-quantized "
                         f"weights (read by {', '.join(readers)}); leave quantization unset to "
                         "use the checkpoint's own")
    return requested


def build_method(name: str, path: str, hf_config: Any) -> QuantizationMethod:
    """The registered method configured from the checkpoint (its own metadata)."""
    from ember.registry import QuantizationRegistry

    obj = QuantizationRegistry.resolve(name)
    if isinstance(obj, type) and issubclass(obj, QuantizationMethod):
        return obj.from_checkpoint(path, hf_config)
    return obj() if isinstance(obj, type) else obj


# ---- what the engine calls around building the model -----------------------------------------


def prepare_method(name: str | None, path: str, hf_config: Any, device_type: str,
                   dtype: torch.dtype) -> QuantizationMethod | None:  # fmt: skip
    """The configured method for a resolved name (None: float), checked against the platform
    and dtype (ValueError naming what it cannot run)."""
    if name is None:
        return None
    method = build_method(name, path, hf_config)
    method.check_supported(device_type, dtype)
    return method


def building_with(method: QuantizationMethod | None):  # type: ignore[no-untyped-def]
    """Context for building the model: its Linear layers get the method's LinearMethod."""
    from ember.layers.linear import linear_method_provider

    active = method if method is not None and method.loads_quantized else None
    stack = contextlib.ExitStack()
    stack.enter_context(linear_method_provider(linear_method_provider_for(active)))
    if active is not None:
        stack.enter_context(active.loading_context())
    return stack


def finish_loading(model: nn.Module, method: QuantizationMethod | None) -> tuple[int, int]:
    """After every tensor is in: the post-load path's ``quantize_model``, every layer's
    ``process_weights_after_loading``, then the method's model-wide step. Returns (layers
    quantized, weight bytes in memory)."""
    from ember.layers.linear import process_weights_after_loading

    count = 0
    if method is not None and not method.loads_quantized:
        count = quantize_model(model, method)
    process_weights_after_loading(model)
    if method is not None and method.loads_quantized:
        method.process_model_after_loading(model)
        count = quantized_layers(model)
    return count, weight_bytes(model)


def quantized_layers(model: nn.Module) -> int:
    """How many Linear layers a checkpoint method computes."""
    from ember.layers.linear import Linear, UnquantizedLinearMethod

    return sum(1 for m in model.modules() if isinstance(m, Linear)
               and not isinstance(m.quant_method, UnquantizedLinearMethod))


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every parameter, buffer and quantized-layer state (each tensor once)."""
    tensors: dict[int, torch.Tensor] = {}
    for t in [*model.parameters(), *model.buffers()]:
        tensors[id(t)] = t
    for m in model.modules():
        if isinstance(m, QuantizedLinear):
            for t in _state_tensors(m.state):
                tensors[id(t)] = t
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _state_tensors(state: Any) -> list[torch.Tensor]:
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, (tuple, list)):
        return [t for s in state for t in _state_tensors(s)]
    return []
