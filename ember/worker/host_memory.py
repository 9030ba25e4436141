"""Host tensors that cost nothing until written: the CPU KV cache.

A CPU engine's KV cache is gigabytes, most of it never touched by a short run, so it is not
filled up front (``torch.zeros`` writes every byte: seconds for 4 GiB). It is an anonymous
memory mapping instead: the OS hands out zeroed pages as they are first written.

Transparent huge pages are declined for it. numpy's large arrays (``np.zeros`` was used here
before) ask for them with ``madvise(MADV_HUGEPAGE)``, and where the kernel's THP defrag setting
is "madvise" (a common default) a first write into such a region waits for the kernel to
compact memory into a 2 MB page: 5-15 ms a fault on the development machine, 0.34 s of the
default model's start-up (its warm-up step touches every layer's cache), and again whenever a
run reaches fresh cache. Small pages fault in microseconds.
"""

from __future__ import annotations

import math
import mmap

import torch


def lazily_zeroed_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled, page-aligned host tensor whose pages are provided on first write; the
    mapping is released with the tensor."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):  # Linux
        region.madvise(mmap.MADV_NOHUGEPAGE)
    # frombuffer keeps `region` alive as long as the tensor's storage.
    return torch.frombuffer(region, dtype=torch.uint8).view(dtype).view(shape)
