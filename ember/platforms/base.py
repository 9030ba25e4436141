"""The Platform interface: what the engine asks of a device family (cpu, cuda, or a plugin's).

It is the one place that knows the device. The worker and executor ask it to synchronize, to
measure peak memory, to record events, to allocate host staging buffers and copy results home,
and to capture graphs; they never name a device API themselves. Every member has a default that
is right for a plain CPU-like device (work runs on the calling thread, memory is host memory), so
an out-of-tree platform overrides only what its device does differently.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, TypeVar

if TYPE_CHECKING:
    import torch

T = TypeVar("T")


class DeviceEvent(Protocol):
    """A point in the device's work queue; `synchronize()` blocks until the device passes it."""

    def synchronize(self) -> None: ...


class GraphCaptureRefused(RuntimeError):
    """capture_graph could not capture this forward (it did work the graph cannot replay);
    the engine runs its decode steps eagerly instead."""


class Graph(Protocol):
    """A captured device graph: `replay()` reruns the captured work on the captured buffers."""

    def replay(self) -> None: ...


class SynchronizingEvent:
    """The default DeviceEvent: waiting on it waits for all the platform's work (a no-op on a
    device that runs on the calling thread). Correct for any device, if coarse."""

    __slots__ = ("platform",)

    def __init__(self, platform: Platform) -> None:
        self.platform = platform

    def synchronize(self) -> None:
        self.platform.synchronize()


class Platform:
    """A device family. Subclasses set the class attributes and override what differs.

    Nothing here may import torch at module level: platforms are probed while selecting one, and
    selection must stay cheap. Instances are made by ember.platforms.resolve_platform.
    """

    name: ClassVar[str] = ""
    device_type: ClassVar[str] = "cpu"  # the torch device type
    # Attention backends in the order this platform prefers them; the selector takes the first
    # whose declared capabilities fit the model (then the others by priority).
    preferred_attention_backends: ClassVar[list[str]] = ["sdpa"]
    supported_dtypes: ClassVar[list[str]] = ["float32"]
    default_dtype: ClassVar[str] = "float32"
    # Whether decode steps may be captured as graphs (capture_graph below). The engine captures
    # only when the attention backend is graph-safe too and enforce_eager is off.
    supports_cuda_graphs: ClassVar[bool] = False
    # Whether capture_graph itself refuses a forward it cannot replay (GraphCaptureRefused), so
    # that any attention backend may be tried, graph-safe by declaration or not.
    graph_capture_checks_work: ClassVar[bool] = False
    # The largest decode batch captured (None: the engine's own limit).
    max_graph_batch_size: ClassVar[int | None] = None
    # Tokens a step may schedule when max_num_batched_tokens is not given (None: the engine's
    # own default, 8192).
    default_max_num_batched_tokens: ClassVar[int | None] = None
    # Whether the engine overlaps scheduling step N+1 with step N's device work by default. Worth
    # it only where the device runs asynchronously from the host (a GPU); on the CPU the forward
    # pass runs on the calling thread, so there is nothing to overlap.
    async_scheduling_default: ClassVar[bool] = False

    device_index: int | None = None  # set from device="cuda:1"; None = the current device

    @classmethod
    def is_available(cls) -> bool:
        """A cheap probe: must not import heavy libraries or touch the device."""
        return True

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """Why the platform cannot be used here (None when it can); shown to users."""
        return None if cls.is_available() else f"platform {cls.name!r} reports it is unavailable"

    @classmethod
    def detected(cls) -> bool:
        """Whether its hardware is present, even if unusable (e.g. GPU with a CPU-only torch).

        Falling back to the CPU while a detected platform is unusable is logged as a warning.
        """
        return cls.is_available()

    def device(self) -> torch.device:
        import torch

        return torch.device(self.device_type, self.device_index)

    def device_is_host(self) -> bool:
        """Whether device tensors live in host memory, so host arrays can be used in place
        instead of being staged and copied."""
        return self.device_type == "cpu"

    def supports_fp8(self) -> bool:
        """Whether this device computes with float8 (e4m3) values: an fp8 KV cache and fp8
        weights. The host does (in torch ops and under the Triton interpreter)."""
        return True

    # ---- memory --------------------------------------------------------------------------
    def kv_cache_memory_bytes(self, gpu_memory_utilization: float) -> int:
        """Bytes the KV cache may take when the user gives no explicit budget.

        `gpu_memory_utilization` (0 < u <= 1, EngineArgs) is the share of the device's total
        memory the engine may use in all: weights, activations and KV cache. Called after the
        weights are loaded; the engine subtracts the peak activation memory measured by
        `profile_peak_memory`. A platform whose memory is not the device's (the CPU) may ignore it.
        """
        raise NotImplementedError

    def profile_peak_memory(self, run: Callable[[], None]) -> int:
        """Run `run` (the largest step the engine will take) and return the peak bytes of device
        memory it allocated beyond what was in use before. The default returns 0 without running
        it: a platform whose KV budget does not depend on activation memory need not pay for it."""
        return 0

    def empty_cache(self) -> None:
        """Give memory the engine freed back to the device (sleep mode: a caching allocator
        would otherwise keep it). The default has no cache to empty."""
        return None

    def memory_in_use(self) -> int:
        """Bytes of device memory in use by every process (what sleep returns is measured
        with it); 0 where the platform cannot tell."""
        return 0

    # ---- ordering and transfers --------------------------------------------------------
    def synchronize(self) -> None:
        """Block until all work queued on the device is done (a no-op for a synchronous one)."""
        return None

    def record_event(self) -> DeviceEvent:
        """Mark the current point of the device's work queue (after the work queued so far)."""
        return SynchronizingEvent(self)

    def empty_host_buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A 1-D host tensor for staging copies to the device (page-locked where that makes the
        copies asynchronous). The default is ordinary host memory."""
        import torch

        return torch.empty(numel, dtype=dtype)

    def pin_host_memory(self, tensor: torch.Tensor) -> Callable[[], None] | None:
        """Page-lock the memory of an existing host tensor (shared memory another process
        writes), so that copies from it to the device run as asynchronously as from
        empty_host_buffer's; returns the undo, to call before the memory goes. The default
        (and a platform that cannot) returns None: copies from it stay ordinary."""
        return None

    def copy_to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        """Start copying a device tensor to the host without waiting. The result may be read once
        an event recorded after this call has been synchronized. The default copies at once (and
        returns a host tensor as it is)."""
        return tensor if tensor.device.type == "cpu" else tensor.to("cpu")

    # ---- graphs (only called when supports_cuda_graphs) ------------------------------------
    def graph_memory_pool(self) -> Any:
        """A memory pool that graphs captured one after another share."""
        raise NotImplementedError(f"platform {self.name!r} does not capture graphs")

    def capture_graph(self, run: Callable[[], T], pool: Any) -> tuple[Graph, T]:
        """Capture the device work of `run()` into a graph using `pool`; returns the graph and
        run's result (tensors that each replay overwrites). May raise GraphCaptureRefused."""
        raise NotImplementedError(f"platform {self.name!r} does not capture graphs")

    def seed_everything(self, seed: int) -> None:
        import torch

        torch.manual_seed(seed)

    # ---- several processes (tensor / pipeline parallelism) ---------------------------------
    def distributed_backend(self) -> str:
        """The torch.distributed backend the ranks of one engine join ("gloo" by default)."""
        return "gloo"

    def communicator_cls(self) -> type:
        """The class that runs collectives for the layers (ember.distributed.communicator's
        interface); a platform with its own collective library returns its own."""
        from ember.distributed.communicator import Communicator

        return Communicator

    def set_device_for_rank(self, local_rank: int) -> None:
        """Bind this worker process to its device (`local_rank`: its index on this machine).
        A host-memory device has nothing to bind."""
        if not self.device_is_host():
            self.device_index = local_rank

    def __repr__(self) -> str:
        index = "" if self.device_index is None else f":{self.device_index}"
        return f"<{type(self).__name__} {self.name}{index}>"
