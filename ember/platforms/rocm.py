"""ROCm detection: an AMD GPU is recognised, and reported as not supported yet.

Registered so that `device="rocm"` fails with a clear reason, and so that falling back to the CPU
on a machine with an AMD GPU is a logged warning rather than a silent choice. Its device operations
are CUDA's (torch exposes HIP through the same `torch.cuda` API); graph capture stays off until
it is tested on AMD hardware.
"""

from __future__ import annotations

import os
import sys
from typing import ClassVar

from ember.platforms.cuda import CudaPlatform


def rocm_detected() -> bool:
    torch = sys.modules.get("torch")
    if torch is not None and getattr(torch.version, "hip", None):
        return True
    return os.path.exists("/dev/kfd")


def rocm_probe() -> tuple[bool, str]:
    if rocm_detected():
        return False, "an AMD GPU (ROCm) is present, but ember does not support ROCm yet"
    return False, "no AMD GPU found (no /dev/kfd)"


class RocmPlatform(CudaPlatform):
    name: ClassVar[str] = "rocm"
    device_type: ClassVar[str] = "cuda"  # torch exposes HIP devices as "cuda"
    preferred_attention_backends: ClassVar[list[str]] = ["triton", "sdpa"]
    supported_dtypes: ClassVar[list[str]] = ["bfloat16", "float16", "float32"]
    default_dtype: ClassVar[str] = "bfloat16"
    async_scheduling_default: ClassVar[bool] = True
    supports_cuda_graphs: ClassVar[bool] = False

    @classmethod
    def is_available(cls) -> bool:
        return False

    @classmethod
    def unavailable_reason(cls) -> str | None:
        return rocm_probe()[1]

    @classmethod
    def detected(cls) -> bool:
        return rocm_detected()
