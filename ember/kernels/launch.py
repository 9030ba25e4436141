"""What every kernel launch shares: grid arithmetic, the device's SM count, programmatic
dependent launch, the merge counters of single-kernel reductions, and the dot precision.

No triton import here: callers that only size grids or read the SM count (the attention
backend choosing splits) need not load it.
"""

from __future__ import annotations

import functools
import os

import torch

from ember.kernels.buffers import scratch_buffer
from ember.kernels.config import kernel_config


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def warps_for_block(block: int) -> int:
    """About 256 elements per warp, 1 to 8 warps (8 from a block of 2048 on)."""
    return max(1, min(8, block // 256))


def head_pad(head_size: int) -> int:
    # tl.arange needs a power of two and tl.dot needs every dimension >= 16.
    return max(16, next_power_of_2(head_size))


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs must not silently drop to tf32 (tests compare at 1e-5); 16-bit ignore it."""
    return "ieee" if dtype == torch.float32 else "tf32"


def cuda_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.cache
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (cached: the query is not free). Other
    devices only run kernels under TRITON_INTERPRET, one program at a time: a small count
    keeps split grids (and tests) small."""
    if device.type != "cuda":
        return 4
    return _cuda_sms(cuda_index(device))


@functools.cache
def _interpreted() -> bool:
    # Triton reads TRITON_INTERPRET once, as it defines a kernel; so does this, at first use.
    return os.environ.get("TRITON_INTERPRET") == "1"


def compiled_for_gpu(x: torch.Tensor) -> bool:
    """Whether kernels launched on x's device are compiled for it (not TRITON_INTERPRET=1)."""
    return x.is_cuda and not _interpreted()


@functools.cache
def _sm90_or_newer(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl_options(x: torch.Tensor) -> dict[str, bool]:
    """Launch options for a kernel with a ``PDL`` constexpr, given a tensor on its device.

    With programmatic dependent launch (sm90+, KernelConfig.pdl) a kernel may start while the
    kernel before it in the stream is still running, once that one's programs have all called
    ``gdc_launch_dependents``: its launch latency and ramp then overlap the previous kernel's
    tail, which matters when a decode step is hundreds of short kernels. The contract every
    PDL kernel keeps (CUDA graphs capture it as is):
    - it calls ``gdc_wait()`` (which returns once the previous kernel has finished and its
      writes are visible) before touching any memory an earlier kernel may write or read, and
      always calls it, so that waiting is transitive down the stream;
    - it calls ``gdc_launch_dependents()`` only after that wait, so at most one kernel waits
      ahead.
    Only immutable inputs (weights) may be read before the wait.
    """
    on = kernel_config().pdl and compiled_for_gpu(x) and _sm90_or_newer(cuda_index(x.device))
    return {"PDL": True, "launch_pdl": True} if on else {"PDL": False}


# Per device, int32 counts that are zero between launches. A kernel whose last program to finish
# merges the others' partial results (argmax over chunks, split-K linear) counts in it and
# resets what it used; launches on one stream run in turn, so they can share it. Always asked
# for at its full size: CUDA graphs keep its address, so it is never reallocated.
MERGE_COUNTERS = 1 << 16


def merge_counters(n: int, device: torch.device) -> torch.Tensor:
    """The device's zeroed merge counters (at least ``n`` of them)."""
    assert n <= MERGE_COUNTERS, f"{n} merge counters asked, {MERGE_COUNTERS} exist"
    return scratch_buffer("merge_counters", MERGE_COUNTERS, torch.int32, device, zeroed=True)
