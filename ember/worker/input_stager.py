"""InputStager: moves a step's host arrays to the device through persistent pinned buffers.

On CUDA, copies from pinned memory are truly asynchronous, so the host can go on building the
next step. A pinned buffer must not be overwritten while its last copy may still be in flight:
an event recorded after the copies guards that. On the CPU the arrays are used in place.
"""

from __future__ import annotations

import numpy as np
import torch


class InputStager:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pinned = device.type == "cuda"
        self._buffers: dict[str, torch.Tensor] = {}
        self._copies_done: torch.cuda.Event | None = None

    def begin(self) -> None:
        """Call before staging a new step: waits until the previous step's copies have landed."""
        if self._copies_done is not None:
            self._copies_done.synchronize()
            self._copies_done = None

    def to_device(self, name: str, array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        if not self.pinned:
            return torch.from_numpy(np.ascontiguousarray(array)).to(dtype)
        numel = array.size
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != dtype:
            capacity = max(numel, 2 * (buf.numel() if buf is not None else 0), 256)
            buf = torch.empty(capacity, dtype=dtype, pin_memory=True)
            self._buffers[name] = buf
        host = buf[:numel]
        host.numpy()[:] = array.reshape(-1)
        return host.view(array.shape).to(self.device, non_blocking=True)

    def end(self) -> None:
        """Call after the step's last to_device."""
        if self.pinned:
            self._copies_done = torch.cuda.Event()
            self._copies_done.record()
