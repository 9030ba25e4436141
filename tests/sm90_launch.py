"""Compile a Triton kernel for sm90 (Hopper) as its launch wrapper would launch it, without a
GPU: the wrapper runs on CPU tensors with its kernel replaced by a recorder and a GPU's launch
choices patched into every kernel module (``compiled_for_gpu`` true, no soft fp8 rounding,
PDL on); the recorded arguments give the signature (pointer types from the tensors' dtypes,
16-divisibility as a launch specializes it) and the constexprs, and triton's own compiler
(ptxas included) builds that for sm90.

Import it only in a process without TRITON_INTERPRET (the compile tests run it in a fresh
interpreter)."""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from types import ModuleType

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import ember.kernels

TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32",
         torch.int32: "i32", torch.int64: "i64", torch.uint8: "u8", torch.int8: "i8",
         torch.float8_e4m3fn: "fp8e4nv"}
# The launch choices of a CUDA device, patched into every kernel module while recording.
GPU_CHOICES = {"compiled_for_gpu": lambda x: True, "soft_fp8": lambda x: False,
               "pdl_options": lambda x: {"PDL": True}}
MODULES = [importlib.import_module(f"ember.kernels.{m.name}")
           for m in pkgutil.iter_modules(ember.kernels.__path__)]


class Recorder:
    """Stands in for a jitted kernel: ``kernel[grid](*args, **kwargs)`` records the call."""

    def __init__(self, kernel) -> None:
        self.kernel, self.calls = kernel, []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((args, kwargs))


def _arg_type(value) -> tuple[str, bool]:
    if isinstance(value, torch.Tensor):
        return "*" + TYPES[value.dtype], value.data_ptr() % 16 == 0
    if isinstance(value, bool):
        return "i1", False
    if isinstance(value, int):
        return ("i32" if -2**31 <= value < 2**31 else "i64"), value % 16 == 0
    return "fp32", False


def _compile(kernel, args, kwargs) -> tuple[dict, str]:
    names = kernel.arg_names
    options = {k: kwargs[k] for k in ("num_warps", "num_stages") if k in kwargs}
    consts = {k: v for k, v in kwargs.items() if k in names}
    signature, attrs = {}, {}
    for i, (name, value) in enumerate(zip(names, args)):
        if value is None:
            consts[name] = None
            continue
        signature[name], aligned = _arg_type(value)
        if aligned:
            attrs[(i,)] = [["tt.divisibility", 16]]
    signature.update({name: "constexpr" for name in consts})
    src = ASTSource(kernel, signature, attrs=attrs,
                    constexprs={(names.index(k),): v for k, v in consts.items()})
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]
    return consts, ptx


def compile_as_launched(module: ModuleType, attr: str,
                        call: Callable[[], object]) -> list[tuple[dict, str]]:
    """(constexprs, PTX) of every launch of ``module.<attr>`` that ``call()`` makes."""
    recorder = Recorder(getattr(module, attr))
    saved = {(m, n): getattr(m, n) for m in MODULES for n in GPU_CHOICES if hasattr(m, n)}
    setattr(module, attr, recorder)
    for m, n in saved:
        setattr(m, n, GPU_CHOICES[n])
    try:
        call()
    finally:
        setattr(module, attr, recorder.kernel)
        for (m, n), fn in saved.items():
            setattr(m, n, fn)
    assert recorder.calls, (module.__name__, attr, "not launched")
    return [_compile(recorder.kernel, args, kwargs) for args, kwargs in recorder.calls]
