"""Launching a jitted Triton kernel that runs outside CUDA graphs every step, without triton's
per-call binding.

``kernel[grid](*args)`` binds the arguments, computes the specialization key, finds the compiled
kernel and launches it: 35-45 us of host time a call on an H100 host (the masked argmax of a
structured-output step, ``ember.kernels.argmax``), against ~12 for a torch op. A kernel launched
eagerly each step (outside the decode step's CUDA graphs) can instead keep the compiled kernel
triton returned for its first launch and, while what specializes it is the same, launch that
directly (``CompiledKernel[grid](*args)``, triton's own launcher). What specializes it is taken
stricter than triton's rule: every int and constexpr by value, each tensor by dtype, device and
16-byte alignment. Under TRITON_INTERPRET (or a stand-in for the kernel, as the compile tests
install) a launch returns no compiled kernel, so every launch goes through the JIT.
"""

from __future__ import annotations

from typing import Any

import torch

_COMPILED: dict[tuple, Any] = {}


def _specialized(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return (value.dtype, value.device, value.data_ptr() % 16 == 0)
    return value


def launch(kernel: Any, grid: tuple[int, ...], args: tuple, constexprs: dict[str, Any],
           **options: Any) -> None:
    """``kernel[grid](*args, **constexprs, **options)``, with ``args`` the kernel's leading
    parameters in order and ``constexprs`` all the ones after them."""
    key = (id(kernel), tuple(map(_specialized, args)), tuple(constexprs.values()),
           tuple(options.items()))
    compiled = _COMPILED.get(key)
    if compiled is not None:
        compiled[grid](*args, *constexprs.values())
        return
    compiled = kernel[grid](*args, **constexprs, **options)
    from triton.compiler import CompiledKernel

    names = getattr(kernel, "arg_names", None)
    # Only a compiled kernel whose parameters are exactly args then constexprs (the direct
    # launch passes them by position).
    if (isinstance(compiled, CompiledKernel) and names is not None
            and list(names[len(args):]) == list(constexprs)):
        _COMPILED[key] = compiled
