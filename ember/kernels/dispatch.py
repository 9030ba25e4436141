"""Whether a layer takes ember's Triton kernel or its torch ops.

Decided in two parts: ``layer_kernels_enabled()`` once, as a layer is built (the kernel
configuration, and whether triton is installed at all), and ``takes_kernel(x)`` per call from
the tensor alone (models are built on the meta device, so only the call knows the device). The
torch ops stay for the CPU, for float32 (bit-identical to HF transformers) and under
torch.compile (inductor fuses them itself).
"""

from __future__ import annotations

import functools
import importlib.util

import torch

from ember.kernels.config import kernel_config

HALF_DTYPES = (torch.float16, torch.bfloat16)


@functools.cache
def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def layer_kernels_enabled() -> bool:
    """Whether layers built now may use the kernels (KernelConfig.triton_layers, triton)."""
    return kernel_config().triton_layers and triton_installed()


def on_gpu(x: torch.Tensor) -> bool:
    """Whether ``x`` lives where compiled kernels run, outside a torch.compile trace."""
    return x.is_cuda and not torch.compiler.is_compiling()


def takes_kernel(x: torch.Tensor) -> bool:
    """Whether an elementwise/linear layer should run ``x`` through its kernel: CUDA, half."""
    return x.dtype in HALF_DTYPES and on_gpu(x)
