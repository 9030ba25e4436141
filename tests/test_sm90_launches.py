"""The weight-streaming linear kernels compiled for sm90 (Hopper) with the arguments their own
launch wrappers pass, on a machine without a GPU.

Interpreter tests run the kernels' arithmetic but not the compiler, and a compile test that
writes a kernel's signature by hand can differ from what the launch passes: a one-split launch
hands its output tensor in as the K-split merge's counters, and atomics compiled on it (bf16)
broke every small-batch linear launch on the GPU while every CPU test passed. Here each wrapper
runs on CPU tensors with the kernel replaced by a recorder; the recorded arguments give the
signature (pointer types from the tensors' dtypes, 16-divisibility as a launch specializes it)
and the constexprs, and triton compiles that for sm90. Run in a fresh interpreter: this
process may have TRITON_INTERPRET set.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

_SCRIPT = r'''
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from ember.kernels import fp8_gemv, int4_gemv, small_batch_linear

TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32",
         torch.int32: "i32", torch.int64: "i64", torch.uint8: "u8",
         torch.float8_e4m3fn: "fp8e4nv"}


class Recorder:
    """Stands in for a jitted kernel: ``kernel[grid](*args, **kwargs)`` records the call."""

    def __init__(self, kernel):
        self.kernel, self.calls = kernel, []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((args, kwargs))


def compile_recorded(kernel, args, kwargs):
    names = kernel.arg_names
    options = {k: kwargs[k] for k in ("num_warps", "num_stages") if k in kwargs}
    consts = {k: v for k, v in kwargs.items() if k in names}
    consts["PDL"] = True  # as on an sm90 GPU (the CPU launch turns it off)
    signature, attrs = {}, {}
    for i, (name, value) in enumerate(zip(names, args)):
        if isinstance(value, torch.Tensor):
            signature[name] = "*" + TYPES[value.dtype]
            aligned = value.data_ptr() % 16 == 0
        else:
            signature[name] = "i32"
            aligned = value % 16 == 0
        if aligned:
            attrs[(i,)] = [["tt.divisibility", 16]]
    signature.update({name: "constexpr" for name in consts})
    src = ASTSource(kernel, signature, attrs=attrs,
                    constexprs={(names.index(k),): v for k, v in consts.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]


def run(module, attr, call):
    recorder = Recorder(getattr(module, attr))
    setattr(module, attr, recorder)
    try:
        call()
    finally:
        setattr(module, attr, recorder.kernel)
    (args, kwargs), = recorder.calls
    return compile_recorded(recorder.kernel, args, kwargs)


torch.manual_seed(0)
k, n, group = 1024, 512, 128
x = torch.randn(1, k).bfloat16()
w = torch.randn(n, k).bfloat16()
qweight = torch.randint(0, 2**31 - 1, (k // 8, n), dtype=torch.int32)
qzeros = torch.randint(0, 2**31 - 1, (k // group, n // 8), dtype=torch.int32)
scales = torch.rand(k // group, n).bfloat16()
w8 = torch.randn(n, k).to(torch.float8_e4m3fn)
w_scale = torch.rand(n)
x8, x_scale = x.to(torch.float8_e4m3fn), torch.rand(1, 1)
compiled = 0
for split in (1, 4):  # unsplit launches pass their output as the merge's buffers
    cases = [
        (small_batch_linear, "_small_batch_linear_kernel",
         lambda: small_batch_linear.small_batch_linear(x, w, config=(32, 256, split))),
        (int4_gemv, "_int4_gemv_kernel",
         lambda: int4_gemv.int4_gemv(x, qweight, qzeros, scales, group,
                                     config=(128, 128, split, 4, 4, True))),
        (int4_gemv, "_int4_gemv_kernel",
         lambda: int4_gemv.int4_gemv(x.expand(4, k), qweight, qzeros, scales, group,
                                     config=(64, 128, split, 4, 4))),
        (fp8_gemv, "_fp8_gemv_kernel",
         lambda: fp8_gemv.fp8_gemv(x, w8, w_scale, config=(64, 256, split, 4, 4))),
        (fp8_gemv, "_fp8_gemv_kernel",
         lambda: fp8_gemv.fp8_gemv(x8, w8, w_scale, config=(64, 256, split, 4, 4),
                                   x_scale=x_scale)),
    ]
    for module, attr, call in cases:
        run(module, attr, call)
        compiled += 1
print("compiled", compiled)
'''


@pytest.mark.slow
def test_linear_kernels_compile_for_sm90_as_launched():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.strip().endswith("compiled 10"), proc.stdout[-2000:]
