"""The Platform interface: what the engine asks of a device family (cpu, cuda, or a plugin's)."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    import torch


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
    supports_cuda_graphs: ClassVar[bool] = False
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

    def kv_cache_memory_bytes(self, gpu_memory_utilization: float) -> int:
        """Bytes the KV cache may take when the user gives no explicit budget."""
        raise NotImplementedError

    def synchronize(self) -> None:
        return None

    def seed_everything(self, seed: int) -> None:
        import torch

        torch.manual_seed(seed)

    def __repr__(self) -> str:
        index = "" if self.device_index is None else f":{self.device_index}"
        return f"<{type(self).__name__} {self.name}{index}>"
