"""The CPU platform: float32 by default, the SDPA backend, KV cache sized from free RAM.

Its device operations are the Platform defaults: work runs on the calling thread and tensors live
in host memory, so there is nothing to wait for, pin or copy. Decode graphs are the forward's
native calls (ember.kernels.cpu.native): captured where every op of the forward is one (float32
models of the Llama family with the SDPA backend), replayed without the layers' Python; any
other forward is refused at capture and runs eagerly.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any, ClassVar, TypeVar

from ember.platforms.base import GraphCaptureRefused, Platform

T = TypeVar("T")

logger = logging.getLogger("ember")
_DEFAULT_CPU_KV_BYTES = 4 << 30  # like vLLM's VLLM_CPU_KVCACHE_SPACE default of 4 GiB


class CpuPlatform(Platform):
    name: ClassVar[str] = "cpu"
    device_type: ClassVar[str] = "cpu"
    preferred_attention_backends: ClassVar[list[str]] = ["sdpa"]
    supported_dtypes: ClassVar[list[str]] = ["float32", "bfloat16", "float16"]
    default_dtype: ClassVar[str] = "float32"
    supports_cuda_graphs: ClassVar[bool] = True  # native-call graphs, see the module docstring
    graph_capture_checks_work: ClassVar[bool] = True
    # Past a few dozen rows a step's work outweighs its Python; each size keeps its own buffers.
    max_graph_batch_size: ClassVar[int | None] = 32
    # Smaller prefill chunks keep a step's activations in the last-level cache (the default
    # model's gate/up output is 25 MB at 2,048 tokens, 100 MB at 8,192): the 32-request batch of
    # docs/benchmarks.md ran ~9% faster. vLLM's CPU backend also defaults to 2,048 for serving.
    default_max_num_batched_tokens: ClassVar[int | None] = 2048

    def graph_memory_pool(self) -> Any:
        return None  # each graph keeps the tensors its calls touch

    def capture_graph(self, run: Callable[[], T], pool: Any) -> tuple[Any, T]:
        from ember.kernels.cpu import native

        try:
            return native.capture(run)
        except native.CaptureRefused as exc:
            raise GraphCaptureRefused(str(exc)) from None

    def kv_cache_memory_bytes(self, gpu_memory_utilization: float) -> int:
        # gpu_memory_utilization has no meaning for host RAM (vLLM's CPU backend ignores it too);
        # cap at a quarter of what is free. A value the user changed is told it did nothing.
        from ember.config import EngineArgs

        if gpu_memory_utilization != EngineArgs.gpu_memory_utilization:
            logger.warning("gpu_memory_utilization=%s has no effect on the CPU platform: its KV "
                           "cache takes min(4 GiB, a quarter of free RAM); set "
                           "kv_cache_memory_bytes for another size", gpu_memory_utilization)
        available = available_host_memory_bytes()
        if available is None:
            return _DEFAULT_CPU_KV_BYTES
        return int(min(_DEFAULT_CPU_KV_BYTES, available // 4))


def available_host_memory_bytes(meminfo_path: str = "/proc/meminfo") -> int | None:
    """RAM a new allocation can get: Linux's MemAvailable, which counts the page cache the kernel
    drops on demand. Bare free pages (MemFree) are no measure: after reading a few model files
    most RAM is page cache, and a KV cache sized from MemFree shrank below one request."""
    try:
        with open(meminfo_path) as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # reported in kB
    except OSError:
        pass
    try:  # not Linux: free pages are the best the OS says
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return None
