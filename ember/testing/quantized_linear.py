"""Conformance check of a checkpoint-path quantization method's linear layers (AWQ, GPTQ, fp8 and
plugins' own) against the float weights their checkpoint tensors stand for.

    lines = check_quantized_linear("awq", awq_tensors, config={"group_size": 64})

For each shape the kit builds a fused ``Linear`` (two output shards, as q/k/v or gate/up are) the
way the engine does (the method's ``get_linear_method`` while the layer is built), makes each
shard's checkpoint tensors with ``make_tensors(weight [out, in]) -> (tensors, dequantized)``,
loads them through the parameters' ``weight_loader`` with the shard index, runs
``process_weights_after_loading``, then checks:

- the layer's own dequantized weight (its LinearMethod's ``dequantize_weight(layer)``, when it
  has one) equals the shards' dequantized values: loading and repacking lose nothing;
- ``layer(x)`` for every batch size and dtype is within the method's bound of
  ``x @ dequantized.T + bias``: ``atol`` / ``rtol`` relative to the largest output magnitude
  (a method that quantizes activations, like fp8, states a looser bound);
- where the layer asks for its input quantized (``Linear.quantized_input_dtype``: fp8, or
  int8 for a 4-bit layer's integer GEMV), also ``layer`` of x quantized as a producer kernel
  writes it, within the same bound.
Raises AssertionError naming the failing case; returns one summary line per case.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from ember.registry.capabilities import canonical_dtype

_TOL = {"float32": 1e-4, "float16": 1e-2, "bfloat16": 2e-2}


def _method(method: Any, config: dict[str, Any] | None) -> Any:
    from ember.registry import QuantizationRegistry

    obj = QuantizationRegistry.resolve(method) if isinstance(method, str) else method
    if isinstance(obj, type):
        from_config = getattr(obj, "from_config", None)
        return from_config(dict(config or {})) if from_config else obj()
    return obj


def _build(impl: Any, in_f: int, sizes: list[int], bias: bool, dtype: torch.dtype,
           device: str, prefix: str):  # type: ignore[no-untyped-def]
    from ember.layers.linear import Linear, linear_method_provider
    from ember.quantization.base import linear_method_provider_for

    with linear_method_provider(linear_method_provider_for(impl)), torch.device(device):
        return Linear(in_f, sum(sizes), bias, dtype=dtype, output_sizes=sizes, prefix=prefix)


def _as_producer_writes(x: torch.Tensor, dtype: torch.dtype) -> Any:
    """x quantized to ``dtype`` as the kernel before a layer (RMSNorm, SiLU-and-mul) writes it
    when the layer asks for it, by ember's standalone quantizer of the same form."""
    from ember import kernels
    from ember.layers.linear import QuantizedActivation

    if dtype == torch.int8:
        return QuantizedActivation(*kernels.int8_act.quantize_int8(x))
    if dtype == torch.float8_e4m3fn:
        return QuantizedActivation(*kernels.fp8_quant.per_token_fp8(x))
    raise AssertionError(f"the layer asks for {dtype} input, which no producer writes")


def check_quantized_linear(
    method: Any,
    make_tensors: Callable[[torch.Tensor], tuple[dict[str, torch.Tensor], torch.Tensor]],
    *,
    config: dict[str, Any] | None = None,
    shapes: Iterable[tuple[list[int], int]] = (([64, 32], 128), ([96, 64], 256)),
    batch_sizes: Iterable[int] = (1, 7, 33),
    dtypes: Iterable[str] = ("float32",),
    bias: bool = True,
    device: str = "cpu",
    atol: float | None = None,
    seed: int = 0,
) -> list[str]:
    """Check ``method`` (a registered name, a class (built by its ``from_config(config)`` when
    it has one) or an instance); ``shapes`` are (output shard sizes, in_features)."""
    from ember.layers.linear import bind_weight_loaders, weight_loader

    impl = _method(method, config)
    label = type(impl).__name__
    gen = torch.Generator().manual_seed(seed)
    lines = []
    for dtype_name in (canonical_dtype(d) for d in dtypes):
        dtype = getattr(torch, dtype_name)
        bound = atol if atol is not None else _TOL[dtype_name]
        for sizes, in_f in shapes:
            case = f"{dtype_name} {sizes}x{in_f}"
            layer = _build(impl, in_f, list(sizes), bias, dtype, device,
                           "model.layers.0.mlp.gate_up_proj")
            params = bind_weight_loaders(torch.nn.ModuleDict({"proj": layer}))
            parts = []
            for shard, out_f in enumerate(sizes):
                weight = torch.randn(out_f, in_f, generator=gen) / in_f**0.5
                tensors, deq = make_tensors(weight)
                for name, tensor in tensors.items():
                    if f"proj.{name}" not in params:
                        raise AssertionError(f"{label} [{case}]: the layer has no parameter "
                                             f"{name!r} (has {sorted(params)})")
                    param = params[f"proj.{name}"]
                    weight_loader(param)(param, tensor.to(device), shard)
                parts.append(deq.float())
            want_w = torch.cat(parts).to(device)
            b = torch.randn(sum(sizes), generator=gen).to(device, dtype) if bias else None
            if bias:
                weight_loader(layer.bias)(layer.bias, b, None)
            layer.quant_method.process_weights_after_loading(layer)
            deq_fn = getattr(layer.quant_method, "dequantize_weight", None)
            if deq_fn is not None:
                got_w = deq_fn(layer).float()
                if not torch.equal(got_w, want_w):
                    err = (got_w - want_w).abs().max().item()
                    raise AssertionError(f"{label} [{case}]: the loaded layer's weight differs "
                                         f"from the checkpoint's dequantized value by {err:.3g}")
            worst = 0.0
            for n in batch_sizes:
                x = torch.randn(n, in_f, generator=gen).to(device, dtype)
                want = x.float() @ want_w.T + (b.float() if b is not None else 0.0)
                inputs = {"": x}
                quantized = layer.quantized_input_dtype(x)
                if quantized is not None:
                    inputs[f", input in {quantized}"] = _as_producer_writes(x, quantized)
                for how, layer_input in inputs.items():
                    got = layer(layer_input)
                    if tuple(got.shape) != (n, sum(sizes)) or got.dtype != dtype:
                        raise AssertionError(f"{label} [{case}, batch {n}{how}]: output "
                                             f"{got.dtype} {tuple(got.shape)}, expected "
                                             f"{dtype} {(n, sum(sizes))}")
                    err = (got.float() - want).abs().max().item() / want.abs().max().item()
                    worst = max(worst, err)
                    if not err <= bound:
                        raise AssertionError(f"{label} [{case}, batch {n}{how}]: output "
                                             f"differs from x @ dequantized.T by {err:.3g} of "
                                             f"its largest magnitude (bound {bound})")
            lines.append(f"ok  {case}: output error {worst:.3g} (bound {bound})")
    return lines
