"""InputStager: moves a step's host arrays to the device through persistent staging buffers.

Where the device has its own memory, the platform gives host buffers whose copies are truly
asynchronous (pinned, on CUDA), so the host can go on building the next step. A staging buffer
must not be overwritten while a copy out of it may still be pending. The copies of a step are
queued behind the previous step's forward, so with one step in flight (async scheduling) they land
only when that forward ends: two sets of buffers used in turn let step N+1 be staged while step N
still waits to copy. An event recorded after each step's copies guards its set; by the time a set
comes round again, the step that used it has been resolved. Where the device is the host
(the CPU), the arrays are used in place.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from ember.platforms.base import DeviceEvent, Platform

_NUM_SETS = 2


class InputStager:
    def __init__(self, platform: Platform) -> None:
        self.platform = platform
        self.device = platform.device()
        self.in_place = platform.device_is_host()
        self._sets: list[dict[str, torch.Tensor]] = [{} for _ in range(_NUM_SETS)]
        self._copies_done: list[DeviceEvent | None] = [None] * _NUM_SETS
        self._current = 0

    def begin(self) -> None:
        """Call before staging a new step: switches to the other buffer set, waiting (rarely)
        until the copies of the step that last used it have landed."""
        self._current = (self._current + 1) % _NUM_SETS
        done = self._copies_done[self._current]
        if done is not None:
            done.synchronize()
            self._copies_done[self._current] = None

    def to_device(self, name: str, array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        if self.in_place:
            return torch.from_numpy(np.ascontiguousarray(array)).to(dtype)
        numel = array.size
        buffers = self._sets[self._current]
        buf = buffers.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != dtype:
            capacity = max(numel, 2 * (buf.numel() if buf is not None else 0), 256)
            buf = self.platform.empty_host_buffer(capacity, dtype)
            buffers[name] = buf
        host = buf[:numel]
        host.numpy()[:] = array.reshape(-1)
        return host.view(array.shape).to(self.device, non_blocking=True)

    def end(self) -> None:
        """Call after the step's last to_device."""
        if not self.in_place:
            self._copies_done[self._current] = self.platform.record_event()
