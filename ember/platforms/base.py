"""The Platform interface: what the engine asks of a device family (cpu, cuda, or a plugin's)."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    import torch


class Platform:
    """A device family. Subclasses set the class attributes and override what differs."""

    name: ClassVar[str] = ""
    device_type: ClassVar[str] = "cpu"  # the torch device type
    preferred_attention_backends: ClassVar[list[str]] = ["sdpa"]
    supported_dtypes: ClassVar[list[str]] = ["float32"]
    default_dtype: ClassVar[str] = "float32"

    @classmethod
    def is_available(cls) -> bool:
        """A cheap probe: must not import heavy libraries or touch the device."""
        return True

    def device(self) -> torch.device:
        import torch

        return torch.device(self.device_type)

    def kv_cache_memory_bytes(self, gpu_memory_utilization: float) -> int:
        """Bytes the KV cache may take when the user gives no explicit budget."""
        raise NotImplementedError

    def synchronize(self) -> None:
        return None

    def seed_everything(self, seed: int) -> None:
        import torch

        torch.manual_seed(seed)
