"""The CUDA platform: bfloat16 by default, FlashInfer/Triton/SDPA, KV cache from free GPU memory.

The probe avoids initialising CUDA (and importing torch): it looks for NVIDIA device files and a
CUDA build of torch in the installed metadata. When torch is already imported it asks torch.
"""

from __future__ import annotations

import glob
import os
import sys
from typing import ClassVar

from ember.platforms.base import Platform


def nvidia_device_present() -> bool:
    return bool(glob.glob("/dev/nvidia[0-9]*")) or os.path.exists("/proc/driver/nvidia/version")


def _visible_devices_hidden() -> bool:
    value = os.environ.get("CUDA_VISIBLE_DEVICES")
    return value is not None and value.strip() in ("", "-1")


def cuda_status() -> tuple[bool, str]:
    """(available, reason when not), without importing torch or creating a CUDA context."""
    if _visible_devices_hidden():
        return False, "CUDA_VISIBLE_DEVICES hides every GPU"
    torch = sys.modules.get("torch")
    if torch is not None:
        if getattr(torch.version, "cuda", None) is None:
            return False, f"torch {torch.__version__} is not built with CUDA"
        if not torch.cuda.is_available():
            return False, "torch.cuda.is_available() is False"
        return True, ""
    if not nvidia_device_present():
        return False, "no NVIDIA GPU found (no /dev/nvidia* device files)"
    try:
        import importlib.metadata as metadata

        version = metadata.version("torch")
    except Exception:  # not installed, or odd metadata: let torch decide later
        return True, ""
    if "+cpu" in version:
        return False, f"an NVIDIA GPU is present but the installed torch {version} is CPU-only"
    return True, ""


def cuda_probe() -> tuple[bool, str]:
    """The registry's probe for "cuda" (see PlatformRegistry: "probe" capability)."""
    return cuda_status()


class CudaPlatform(Platform):
    name: ClassVar[str] = "cuda"
    device_type: ClassVar[str] = "cuda"
    # Provisional order; the lead settles it from GPU measurements (docs/benchmarks.md).
    preferred_attention_backends: ClassVar[list[str]] = ["triton", "flashinfer", "sdpa"]
    supported_dtypes: ClassVar[list[str]] = ["bfloat16", "float16", "float32"]
    default_dtype: ClassVar[str] = "bfloat16"
    async_scheduling_default: ClassVar[bool] = True
    supports_cuda_graphs: ClassVar[bool] = True

    @classmethod
    def is_available(cls) -> bool:
        return cuda_status()[0]

    @classmethod
    def unavailable_reason(cls) -> str | None:
        ok, reason = cuda_status()
        return None if ok else reason

    @classmethod
    def detected(cls) -> bool:
        return nvidia_device_present()

    def kv_cache_memory_bytes(self, gpu_memory_utilization: float) -> int:
        """The share `gpu_memory_utilization` of total memory, minus what is already in use.

        Called after the weights are loaded, so "in use" covers them (and other processes).
        Activation peaks are not profiled yet: the utilization default (0.9) leaves room for them.
        """
        import torch

        free, total = torch.cuda.mem_get_info(self.device())
        used = total - free
        budget = int(total * gpu_memory_utilization) - used
        if budget <= 0:
            gib = 1 << 30
            raise ValueError(
                f"no GPU memory left for the KV cache: {used / gib:.2f} GiB of {total / gib:.2f} "
                f"GiB is in use, above gpu_memory_utilization={gpu_memory_utilization}; raise it "
                "or pass kv_cache_memory_bytes"
            )
        return budget

    def synchronize(self) -> None:
        import torch

        torch.cuda.synchronize()

    def seed_everything(self, seed: int) -> None:
        import torch

        torch.manual_seed(seed)  # seeds every CUDA device too
