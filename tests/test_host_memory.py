"""The CPU KV cache's memory (ember.worker.host_memory): zero-filled, writable, alive as long as
the tensor, and out of transparent huge pages (whose first-touch compaction stalled start-up)."""

from __future__ import annotations

import gc
import os

import pytest
import torch

from ember.worker.host_memory import lazily_zeroed_tensor


def _vm_flags(start: int, nbytes: int) -> list[list[str]]:
    """The VmFlags of every mapping overlapping [start, start + nbytes) (Linux smaps). All of
    them: numpy, for one, advises huge pages for an aligned part of its array, which splits
    the mapping."""
    with open("/proc/self/smaps") as f:
        lines = f.read().splitlines()
    flags, inside = [], False
    for line in lines:
        head = line.split()[0] if line.split() else ""
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo < start + nbytes and start < hi
        elif inside and line.startswith("VmFlags:"):
            flags.append(line.split()[1:])
    assert flags, f"no mapping holds {start:#x}"
    return flags


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_zeroed_writable_and_alive_with_the_tensor(dtype):
    t = lazily_zeroed_tensor((2, 300, 16, 3, 64), dtype)
    assert t.shape == (2, 300, 16, 3, 64) and t.dtype == dtype and t.is_contiguous()
    assert t.data_ptr() % 4096 == 0
    gc.collect()  # nothing but the tensor holds the mapping now
    assert not t.float().any()
    t[1, 299, 15] = 2.0
    t[0, 0, 0] = 1.0
    gc.collect()
    assert t.float().sum().item() == 2.0 * 3 * 64 + 3 * 64


def test_empty_shape():
    assert lazily_zeroed_tensor((2, 0, 16), torch.float32).numel() == 0


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="Linux /proc only")
def test_declines_transparent_huge_pages():
    t = lazily_zeroed_tensor((64, 1024, 1024), torch.uint8)  # 64 MiB: THP-sized
    for flags in _vm_flags(t.data_ptr(), t.numel()):
        assert "nh" in flags and "hg" not in flags, flags
