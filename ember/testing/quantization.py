"""Conformance check of a quantization method against its own dequantized reference.

The method is checked through three calls (the linear-layer side of a quantization method):

    state = method.quantize(weight)            # float [out, in] -> whatever the method stores
    w = method.dequantize(state)               # -> float [out, in]
    y = method.apply(state, x, bias)           # x [..., in] -> [..., out]

`apply` must equal ``x @ dequantize(state).T + bias`` (up to the dtype's rounding) for every
shape, batch size and dtype of the grid: a fused kernel may not compute something other than
what its own weights mean. Optionally the round trip quantize/dequantize must stay within
`max_weight_error` of the original weight (the method's stated precision).

Every weight has an all-zero row (real checkpoints have them: pruned or padded channels). A method
that computes a per-row scale from the row's largest magnitude must not divide by it unguarded.
0 / 0 is NaN, and casting NaN to an integer type is undefined (0 on some devices, garbage on
others), so the kit watches every torch operation inside `quantize` for a NaN or infinite result,
checks that dequantize gives finite values, and that the zero row comes back as zeros.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from ember.registry.capabilities import canonical_dtype

_TOL = {"float32": (1e-4, 1e-4), "float16": (1e-2, 1e-2), "bfloat16": (5e-2, 5e-2)}


class _NonFiniteWatch(TorchFunctionMode):
    """Remembers the first torch operation whose floating-point result has a NaN or inf."""

    def __init__(self) -> None:
        super().__init__()
        self.first: str | None = None

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if (self.first is None and isinstance(out, torch.Tensor) and out.is_floating_point()
                and out.numel() and not bool(torch.isfinite(out).all())):
            self.first = getattr(func, "__name__", str(func))
        return out


def _method(method: Any) -> Any:
    if isinstance(method, str):
        from ember.registry import QuantizationRegistry

        method = QuantizationRegistry.resolve(method)
    return method() if isinstance(method, type) else method


def check_quantization_method(
    method: Any,
    *,
    shapes: Iterable[tuple[int, int]] = ((64, 128), (96, 256)),
    batch_sizes: Iterable[int] = (1, 7, 33),
    dtypes: Iterable[str] = ("float32",),
    bias: bool = True,
    device: str = "cpu",
    atol: float | None = None,
    rtol: float | None = None,
    max_weight_error: float | None = None,
    seed: int = 0,
) -> list[str]:
    """Check `method` (an instance, a class made without arguments, or a registered name);
    AssertionError names the first failing case, else one summary line per case."""
    impl = _method(method)
    label = type(impl).__name__
    gen = torch.Generator().manual_seed(seed)
    lines = []
    for dtype_name in (canonical_dtype(d) for d in dtypes):
        dtype = getattr(torch, dtype_name)
        tol_a, tol_r = _TOL[dtype_name]
        for out_f, in_f in shapes:
            weight = torch.randn(out_f, in_f, generator=gen) / in_f**0.5
            weight[out_f // 2] = 0.0  # an all-zero row
            weight = weight.to(device, dtype)
            b = torch.randn(out_f, generator=gen).to(device, dtype) if bias else None
            with _NonFiniteWatch() as watch:
                state = impl.quantize(weight)
            if watch.first is not None:
                raise AssertionError(
                    f"{label}.quantize computes NaN or inf (in {watch.first}) for the "
                    f"{out_f}x{in_f} weight, whose row {out_f // 2} is all zeros: is a scale of "
                    f"0 divided by? Clamp it, e.g. scale.clamp(min=1e-12)")
            deq = impl.dequantize(state)
            if tuple(deq.shape) != (out_f, in_f):
                raise AssertionError(f"{label}.dequantize gave shape {tuple(deq.shape)}, "
                                     f"expected {(out_f, in_f)}")
            if not torch.isfinite(deq).all():
                raise AssertionError(
                    f"{label}.dequantize gives non-finite values for the {out_f}x{in_f} weight, "
                    f"whose row {out_f // 2} is all zeros")
            if deq[out_f // 2].abs().max().item() != 0.0:
                raise AssertionError(f"{label}: an all-zero weight row does not dequantize to "
                                     f"zeros")
            werr = (deq.float() - weight.float()).abs().max().item()
            if max_weight_error is not None and werr > max_weight_error:
                raise AssertionError(f"{label}: quantize/dequantize changes the {out_f}x{in_f} "
                                     f"weight by {werr:.3g} > {max_weight_error}")
            worst = 0.0
            for n in batch_sizes:
                x = torch.randn(n, in_f, generator=gen).to(device, dtype)
                got = impl.apply(state, x, b)
                want = x.float() @ deq.float().T + (b.float() if b is not None else 0.0)
                if tuple(got.shape) != (n, out_f):
                    raise AssertionError(f"{label}.apply gave shape {tuple(got.shape)}, "
                                         f"expected {(n, out_f)}")
                err = (got.float() - want).abs().max().item()
                worst = max(worst, err)
                if not torch.allclose(got.float(), want, atol=atol or tol_a, rtol=rtol or tol_r):
                    raise AssertionError(
                        f"{label}.apply differs from x @ dequantize(w).T in case [{dtype_name} "
                        f"weight {out_f}x{in_f}, batch {n}]: max abs error {err:.3g}")
            lines.append(f"ok  {dtype_name} {out_f}x{in_f}: apply error {worst:.3g}, "
                         f"weight round-trip error {werr:.3g}")
    return lines
