"""The CUDA platform: bfloat16 by default, Triton/FlashInfer/SDPA, KV cache from free GPU memory,
and the CUDA side of every device operation the engine needs (events, pinned copies, graphs,
memory profiling).

The probe avoids initialising CUDA (and importing torch): it looks for NVIDIA device files and a
CUDA build of torch in the installed metadata. When torch is already imported it asks torch.
"""

from __future__ import annotations

import glob
import logging
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from ember.platforms.base import DeviceEvent, Graph, Platform

logger = logging.getLogger("ember")

if TYPE_CHECKING:
    import torch

T = TypeVar("T")


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
    # Settled from the measurements in docs/benchmarks.md (decode attention kernels, H200):
    # - triton first: its decode kernel reads the KV cache at 97.5% of the copy rate (4.17 TB/s at
    #   64 x 4096) and it is the one built-in backend that is graph-safe, and batch-1 decode
    #   lives on graph replay;
    # - flashinfer second: as fast with tensor cores (4.10 TB/s) but not graph-safe here, and it
    #   needs an optional package; without this list its registry priority (20) would put it
    #   ahead of triton (10);
    # - sdpa last: the reference, which runs everything but gathers the paged KV on every step.
    preferred_attention_backends: ClassVar[list[str]] = ["triton", "flashinfer", "sdpa"]
    supported_dtypes: ClassVar[list[str]] = ["bfloat16", "float16", "float32"]
    default_dtype: ClassVar[str] = "bfloat16"
    async_scheduling_default: ClassVar[bool] = True
    supports_cuda_graphs: ClassVar[bool] = True

    def supports_fp8(self) -> bool:
        """fp8 conversions and tensor cores: compute capability 8.9 (Ada) or newer."""
        import torch

        return torch.cuda.get_device_capability(self.device()) >= (8, 9)

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

        Called after the weights are loaded, so "in use" covers them (and other processes); the
        engine then subtracts the activation peak measured by profile_peak_memory.
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

    def profile_peak_memory(self, run: Callable[[], None]) -> int:
        import torch

        device = self.device()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        run()
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - before
        torch.cuda.empty_cache()  # the profile's activations go back, for the KV cache to take
        return peak

    def synchronize(self) -> None:
        import torch

        torch.cuda.synchronize(self.device())

    def empty_cache(self) -> None:
        import torch

        torch.cuda.synchronize(self.device())
        torch.cuda.empty_cache()

    def memory_in_use(self) -> int:
        import torch

        free, total = torch.cuda.mem_get_info(self.device())
        return total - free

    def record_event(self) -> DeviceEvent:
        import torch

        event = torch.cuda.Event()
        event.record()
        return event

    def empty_host_buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        import torch

        # Pinned: only copies from page-locked memory run asynchronously to the host.
        return torch.empty(numel, dtype=dtype, pin_memory=True)

    def pin_host_memory(self, tensor: torch.Tensor) -> Callable[[], None] | None:
        import torch

        cudart = torch.cuda.cudart()
        pointer = tensor.data_ptr()
        error = int(cudart.cudaHostRegister(pointer, tensor.numel() * tensor.element_size(), 0))
        if error:
            logger.warning("could not page-lock %d bytes of shared host memory (CUDA error %d): "
                           "copies from it will block", tensor.numel() * tensor.element_size(),
                           error)
            return None
        return lambda: cudart.cudaHostUnregister(pointer)

    def copy_to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.device.type == "cpu":
            return tensor
        host = self.empty_host_buffer(tensor.numel(), tensor.dtype).view(tensor.shape)
        return host.copy_(tensor, non_blocking=True)

    def graph_memory_pool(self) -> Any:
        import torch

        return torch.cuda.graph_pool_handle()

    def capture_graph(self, run: Callable[[], T], pool: Any) -> tuple[Graph, T]:
        import torch

        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            result = run()
        return graph, result

    def seed_everything(self, seed: int) -> None:
        import torch

        torch.manual_seed(seed)  # seeds every CUDA device too

    def distributed_backend(self) -> str:
        return "nccl"

    def set_device_for_rank(self, local_rank: int) -> None:
        import torch

        self.device_index = local_rank
        torch.cuda.set_device(local_rank)  # NCCL uses the current device
