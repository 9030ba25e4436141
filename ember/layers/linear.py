"""Linear layers and the weight-loading contract every linear weight follows.

A ``Linear`` does not own its weight format: a ``LinearMethod`` creates its parameters
(``create_weights``), fixes them up once the checkpoint is in (``process_weights_after_loading``)
and computes the layer (``apply``). ``UnquantizedLinearMethod`` registers ``weight`` [out, in]
exactly as ``nn.Linear`` does, and sends small-batch calls on CUDA in half precision to ember's
weight-streaming kernel (ember.kernels.small_batch_linear); a quantization method
(ember.quantization) supplies its own method with its own parameters (``qweight``, ``scales``...).

Every parameter carries its loading metadata (``set_weight_attrs``): ``output_dim`` /
``input_dim`` (which tensor dim indexes output / input features, or None), ``packed_dim`` +
``packed_factor`` (several values per stored element), and ``weight_loader(param, loaded,
shard_id)``. A model's load loop maps a checkpoint name to (parameter, shard index within a fused
projection) and calls the loader; ``default_weight_loader`` narrows the loaded tensor to this
tensor-parallel rank's slice (``tp_split`` "output": column-parallel, "input": row-parallel),
narrows the destination to the shard along ``output_dim`` (offsets scaled by packing), checks
shapes (ValueError naming the weight) and copies. So a method's parameters load under fused
projections and tensor parallelism without code of its own.

Metadata lives on the layer too (``Linear._weight_attrs``) and is put back on the parameters
whenever they are replaced (``to_empty`` from the meta device builds new Parameter objects).
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ember import kernels
from ember.kernels import dispatch
from ember.kernels.cpu import native
from ember.kernels.tuning import SMALL_BATCH_LINEAR_MAX_ROWS

# 64 MB in bf16: an 8B model's qkv and o_proj take the kernel at every batch up to 16.
SMALL_BATCH_MAX_WEIGHT_ELEMENTS = 32 * 2**20
# 256 MB: an 8B model's down and gate_up take it at batch 1 only.
LARGE_WEIGHT_MAX_ELEMENTS = 128 * 2**20
WEIGHT_ATTRS = ("output_dim", "input_dim", "packed_dim", "packed_factor", "weight_loader")
TP_SPLITS = (None, "output", "input")


def small_batch_max_rows(in_features: int, out_features: int) -> int:
    """Up to how many rows a layer of this size takes the kernel (0: never)."""
    elements = in_features * out_features
    if elements > LARGE_WEIGHT_MAX_ELEMENTS:
        return 0
    return SMALL_BATCH_LINEAR_MAX_ROWS if elements <= SMALL_BATCH_MAX_WEIGHT_ELEMENTS else 1


def set_weight_attrs(param: torch.Tensor, attrs: dict[str, Any]) -> None:
    """Attach loading metadata to a parameter (the one way metadata is set)."""
    for key, value in attrs.items():
        if key not in WEIGHT_ATTRS:
            raise ValueError(f"unknown weight attribute {key!r}; known: {', '.join(WEIGHT_ATTRS)}")
        setattr(param, key, value)


class QuantizedActivation(NamedTuple):
    """A linear layer's input as the kernel that wrote it quantized it (RMSNorm, SiLU-and-mul:
    ``Linear.quantized_input_dtype``): ``data`` in that dtype [rows, in], ``scale`` float32
    [rows, 1], or [rows, in / group] where the layer takes one scale per group of columns
    (``Linear.quantized_input_group``) and the producer wrote them; data * scale (each scale
    over its columns) ~= the half-precision activations. int8 data is in
    ember.kernels.int8_act's form (columns in the 4-bit packs' order) and carries ``sums``,
    scale * sum(data) per group."""

    data: torch.Tensor
    scale: torch.Tensor
    sums: torch.Tensor | None = None


def wanted_input_dtype(layer: Linear | None, x: torch.Tensor) -> torch.dtype | None:
    """The dtype the kernel about to write ``x`` (2-D) for ``layer`` should quantize it to
    (float8_e4m3fn, int8: a QuantizedActivation), or None: x as it is."""
    return None if layer is None or x.dim() != 2 else layer.quantized_input_dtype(x)


class LinearMethod:
    """How a linear layer stores and computes its weight (vLLM's LinearMethodBase)."""

    def quantized_input_dtype(self, layer: Linear, x: torch.Tensor) -> torch.dtype | None:
        """The dtype this layer would rather be given ``x`` in, quantized per row by the kernel
        that writes it (``apply`` then gets a QuantizedActivation), or None: x as it is."""
        return None

    def quantized_input_group(self, layer: Linear, x: torch.Tensor) -> int:
        """Given a quantized input (``quantized_input_dtype``): the columns per scale this layer
        also takes for ``x``'s rows, or 0 (the default): one scale per row only. A producer
        that spreads a row over several programs may then scale each group of that many
        columns on its own; one scale per row must always be accepted."""
        return 0

    def weights_to_prefetch(self, layer: Linear, rows: int) -> list[torch.Tensor]:
        """The tensors worth reading into the GPU's L2 cache ahead of a call with ``rows``
        rows, while other kernels leave the memory idle (ember.layers.weight_prefetch), or
        none (the default)."""
        return []

    def create_weights(self, layer: Linear, input_size: int, output_sizes: list[int],
                       dtype: torch.dtype) -> None:  # fmt: skip
        """Register the layer's parameters (``layer.register_weight``) for an [sum(output_sizes),
        input_size] weight. ``output_sizes`` lists the shards of a fused projection."""
        raise NotImplementedError

    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError

    def process_weights_after_loading(self, layer: Linear) -> None:
        """Repack what was loaded into the form ``apply`` computes on (default: nothing)."""


class UnquantizedLinearMethod(LinearMethod):
    """``weight`` [out, in] in the model's dtype, computed by F.linear (or the small-batch kernel)."""

    def create_weights(self, layer: Linear, input_size: int, output_sizes: list[int],
                       dtype: torch.dtype) -> None:  # fmt: skip
        weight = nn.Parameter(torch.empty(sum(output_sizes), input_size, dtype=dtype),
                              requires_grad=False)
        if weight.device.type != "meta":  # nn.Linear's initialisation (free on the meta device)
            nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
        layer.register_weight("weight", weight, {"output_dim": 0, "input_dim": 1})
        layer.small_batch_max_rows = (
            small_batch_max_rows(input_size, sum(output_sizes))
            if dispatch.layer_kernels_enabled() else 0
        )

    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.shape[0] <= layer.small_batch_max_rows and x.dim() == 2 and dispatch.takes_kernel(x):
            return kernels.small_batch_linear.small_batch_linear(x, layer.weight, bias)
        if native.capturing() and x.dim() == 2:
            # A CPU decode graph is being captured: the same matmul (F.linear's own kernels),
            # written into an output the graph keeps, so that replays run it.
            weight = layer.weight
            y = x.new_empty(x.shape[0], weight.shape[0])
            if bias is None:
                return native.torch_call(torch.mm, (x, weight.t()), y, (x, weight))
            return native.torch_call(torch.addmm, (bias, x, weight.t()), y, (x, weight, bias))
        return F.linear(x, layer.weight, bias)


# ---- which method a new layer gets ----------------------------------------------------------

# Set while a model is built (``linear_method_provider``): (layer, prefix) -> LinearMethod or None.
_PROVIDER: list[Callable[[Linear, str], LinearMethod | None]] = []


@contextlib.contextmanager
def linear_method_provider(provider: Callable[[Linear, str], LinearMethod | None]) -> Iterator[None]:
    """Within the block, a Linear built without ``quant_method`` asks ``provider(layer, prefix)``
    for its method (None: unquantized). The engine wraps model construction in it with the
    quantization method in use, so model code never names quantization."""
    _PROVIDER.append(provider)
    try:
        yield
    finally:
        _PROVIDER.pop()


class Linear(nn.Module):
    """y = x W^T + b with W stored and computed by ``quant_method``.

    ``Linear(in, out, bias, dtype=...)`` behaves as ``nn.Linear`` (same parameter names and
    initialisation). ``output_sizes`` splits the output into the shards of a fused projection
    (q/k/v, gate/up) so each checkpoint tensor loads into its slice. ``tp_rank`` / ``tp_size`` /
    ``tp_split`` make the layer a rank's part of a column- ("output") or row- ("input") parallel
    layer: in_features / out_features / output_sizes are then this rank's sizes."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 dtype: torch.dtype | None = None, device: Any = None,
                 quant_method: LinearMethod | None = None,
                 output_sizes: Sequence[int] | None = None, prefix: str = "",
                 tp_rank: int = 0, tp_size: int = 1, tp_split: str | None = None) -> None:  # fmt: skip
        super().__init__()
        if tp_split not in TP_SPLITS:
            raise ValueError(f"tp_split must be one of {TP_SPLITS}, got {tp_split!r}")
        if not 0 <= tp_rank < tp_size:
            raise ValueError(f"tp_rank {tp_rank} is outside tp_size {tp_size}")
        sizes = [out_features] if output_sizes is None else [int(s) for s in output_sizes]
        if sum(sizes) != out_features:
            raise ValueError(f"output_sizes {sizes} do not add up to out_features {out_features}")
        self.in_features, self.out_features = in_features, out_features
        self.output_sizes = sizes
        self.prefix = prefix
        self.tp_rank, self.tp_size, self.tp_split = tp_rank, tp_size, tp_split
        self.small_batch_max_rows = 0
        self._weight_attrs: dict[str, dict[str, Any]] = {}
        dtype = dtype or torch.get_default_dtype()
        if quant_method is None and _PROVIDER:
            quant_method = _PROVIDER[-1](self, prefix)
        self.quant_method = quant_method or UnquantizedLinearMethod()
        with torch.device(device) if device is not None else contextlib.nullcontext():
            self.quant_method.create_weights(self, in_features, list(sizes), dtype)
            if bias:
                b = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False)
                if b.device.type != "meta":
                    bound = 1 / math.sqrt(in_features) if in_features > 0 else 0
                    nn.init.uniform_(b, -bound, bound)
                self.register_weight("bias", b, {"output_dim": 0})
            else:
                self.register_parameter("bias", None)

    def register_weight(self, name: str, param: nn.Parameter, attrs: dict[str, Any]) -> None:
        """Register a parameter with its loading metadata (``weight_loader`` defaults to
        ``default_weight_loader``)."""
        attrs = {"output_dim": None, "input_dim": None, "packed_dim": None, "packed_factor": 1,
                 "weight_loader": default_weight_loader, **attrs}  # fmt: skip
        self.register_parameter(name, param)
        self._weight_attrs[name] = attrs
        set_weight_attrs(param, attrs)

    def _apply(self, fn: Any, recurse: bool = True) -> Linear:  # type: ignore[override]
        # to_empty / to() may build new Parameter objects: give them their metadata back.
        super()._apply(fn, recurse)
        for name, attrs in self._weight_attrs.items():
            param = self._parameters.get(name)
            if param is not None:
                set_weight_attrs(param, attrs)
        return self

    def forward(self, x: torch.Tensor | QuantizedActivation) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)

    def weights_to_prefetch(self, rows: int) -> list[torch.Tensor]:
        return self.quant_method.weights_to_prefetch(self, rows)

    def quantized_input_dtype(self, x: torch.Tensor) -> torch.dtype | None:
        """See LinearMethod.quantized_input_dtype; producers ask before writing ``x``."""
        return self.quant_method.quantized_input_dtype(self, x)

    def quantized_input_group(self, x: torch.Tensor) -> int:
        """See LinearMethod.quantized_input_group."""
        return self.quant_method.quantized_input_group(self, x)

    def extra_repr(self) -> str:
        method = type(self.quant_method).__name__
        tp = f", tp={self.tp_rank}/{self.tp_size} {self.tp_split}" if self.tp_size > 1 else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, {method}{tp}")


def shard_offset_size(layer: Linear, shard_id: int | None, packed: int = 1) -> tuple[int, int]:
    """(offset, size) of output shard ``shard_id`` in this rank's output rows, divided by
    ``packed`` when outputs are packed several to an element."""
    sizes = layer.output_sizes
    if shard_id is None:
        return 0, sum(sizes) // packed
    if not 0 <= shard_id < len(sizes):
        raise ValueError(f"shard {shard_id} of a layer with {len(sizes)} output shards")
    return sum(sizes[:shard_id]) // packed, sizes[shard_id] // packed


def tp_slice(layer: Linear, param: torch.Tensor, loaded: torch.Tensor) -> torch.Tensor:
    """The loaded tensor narrowed to this rank's part along the layer's split dim."""
    if layer.tp_size == 1 or layer.tp_split is None:
        return loaded
    dim = getattr(param, "output_dim" if layer.tp_split == "output" else "input_dim", None)
    if dim is None:  # e.g. a row-parallel bias: every rank loads it whole
        return loaded
    full = loaded.shape[dim]
    if full % layer.tp_size:
        raise ValueError(f"dim {dim} of size {full} does not split over {layer.tp_size} ranks")
    size = full // layer.tp_size
    return loaded.narrow(dim, layer.tp_rank * size, size)


def load_into(layer: Linear, param: torch.Tensor, loaded: torch.Tensor, shard_id: int | None,
              name: str) -> None:  # fmt: skip
    """The default loader with the layer given: TP slice, shard narrowing, shape check, copy."""
    loaded = tp_slice(layer, param, loaded)
    dst = param.data
    out_dim = getattr(param, "output_dim", None)
    if shard_id is not None:
        if out_dim is None:
            raise ValueError(f"weight {name!r}: a shard of a parameter with no output dim")
        packed = param.packed_factor if getattr(param, "packed_dim", None) == out_dim else 1
        dst = dst.narrow(out_dim, *shard_offset_size(layer, shard_id, packed))
    if tuple(loaded.shape) != tuple(dst.shape):
        raise ValueError(f"weight {name!r} has shape {tuple(loaded.shape)}, the model expects "
                         f"{tuple(dst.shape)}")
    dst.copy_(loaded)


def param_owner(param: torch.Tensor) -> tuple[Linear | None, str]:
    """The Linear a parameter belongs to (None outside one) and the name it loads under, as
    ``bind_weight_loaders`` recorded them."""
    return getattr(param, "_ember_layer", None), getattr(param, "_ember_name", "") or "parameter"


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor,
                          shard_id: int | None = None) -> None:  # fmt: skip
    """Copy ``loaded`` into ``param`` (a shard of it for a fused projection, this rank's part
    under tensor parallelism). Parameters outside a Linear (embeddings, norms) take no shard."""
    layer, name = param_owner(param)
    if layer is None:
        if shard_id is not None:
            raise ValueError(f"weight {name!r}: shard {shard_id} of an unsharded parameter")
        if tuple(loaded.shape) != tuple(param.shape):
            raise ValueError(f"weight {name!r} has shape {tuple(loaded.shape)}, the model "
                             f"expects {tuple(param.shape)}")
        param.data.copy_(loaded)
        return
    load_into(layer, param, loaded, shard_id, name)


def bind_weight_loaders(model: nn.Module) -> dict[str, nn.Parameter]:
    """Every parameter of ``model`` by name, each knowing its layer and full name (what the
    default loader needs to slice and to name the weight in errors)."""
    params = {}
    for mod_name, module in model.named_modules():
        for p_name, param in module.named_parameters(recurse=False):
            full = f"{mod_name}.{p_name}" if mod_name else p_name
            param._ember_name = full  # type: ignore[attr-defined]
            param._ember_layer = module if isinstance(module, Linear) else None  # type: ignore[attr-defined]
            params.setdefault(full, param)
    return params


def weight_loader(param: torch.Tensor) -> Callable[..., None]:
    """The parameter's loader (``default_weight_loader`` for parameters that set none)."""
    return getattr(param, "weight_loader", default_weight_loader)


def process_weights_after_loading(model: nn.Module) -> None:
    """Let every layer's method repack what was loaded (once, after the last tensor)."""
    for module in model.modules():
        if isinstance(module, Linear):
            module.quant_method.process_weights_after_loading(module)


def compute_logits(head: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """float32 logits from the head's weight (an lm_head, or the embedding when tied). A
    quantization method may attach a ``logits_method`` to the head (a callable hidden ->
    logits computed from its own copy of the weight)."""
    method = getattr(head, "logits_method", None)
    if method is not None:
        return method(hidden).float()
    return F.linear(hidden, head.weight).float()


# Names this module exported before the kernel moved to ember.kernels.small_batch_linear.
_MOVED = {
    "small_batch_linear": "small_batch_linear",
    "small_gemm_config": "small_batch_linear_config",
    "GemmConfig": "SmallBatchLinearConfig",
    "SMALL_BATCH_MAX_ROWS": "MAX_ROWS",
}


def __getattr__(name: str) -> Any:
    new_name = _MOVED.get(name)
    if new_name is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(f"ember.layers.linear.{name} is deprecated: use "
                  f"ember.kernels.small_batch_linear.{new_name}", DeprecationWarning, stacklevel=2)
    return getattr(kernels.small_batch_linear, new_name)
