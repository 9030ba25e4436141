"""Process-global scratch buffers: one persistent tensor per purpose and device.

Kernels and attention backends keep a few buffers alive across calls: the merge counters of
single-kernel reductions, the split-KV decode workspace, FlashInfer's float workspace, the SDPA
backend's CPU gather buffer. Layers run one after another on a device's stream, so one buffer
per purpose and device serves them all, and a buffer that stays put keeps the address a
captured CUDA graph recorded. This module is the one place that holds them.

A buffer is reallocated only when a call needs more elements (or another dtype) than it has;
callers that must never move (CUDA graphs replaying it) ask for a fixed size every time.
"""

from __future__ import annotations

import torch

_BUFFERS: dict[tuple[str, str], torch.Tensor] = {}


def scratch_buffer(purpose: str, numel: int, dtype: torch.dtype, device: torch.device | str, *,
                   zeroed: bool = False) -> torch.Tensor:
    """The device's buffer for ``purpose``: at least ``numel`` elements of ``dtype``.

    Grown when too small, never shrunk; the whole buffer is returned (callers slice it).
    ``zeroed`` fills a newly allocated buffer with zeros; users of a zeroed buffer restore
    the zeros they disturb, since it is not cleared again.
    """
    key = (purpose, device_key(device))
    buf = _BUFFERS.get(key)
    if buf is None or buf.numel() < numel or buf.dtype != dtype:
        # Drop the old buffer before allocating its successor so both never coexist.
        buf = None
        _BUFFERS.pop(key, None)
        alloc = torch.zeros if zeroed else torch.empty
        buf = _BUFFERS[key] = alloc(numel, dtype=dtype, device=device)
    return buf


def device_key(device: torch.device | str) -> str:
    """One name per physical device: "cuda" means the current CUDA device, so it names the
    same buffer as "cuda:0" when that is current (a reader asking for "cuda" must see what a
    kernel launched on a "cuda:0" tensor wrote)."""
    device = torch.device(device)
    if device.type != "cpu" and device.index is None:
        module = getattr(torch, device.type, None)
        if module is not None and hasattr(module, "current_device"):
            device = torch.device(device.type, module.current_device())
    return str(device)


def scratch_buffers(purpose: str) -> dict[str, torch.Tensor]:
    """The live buffers for ``purpose``, by device (what tests inspect)."""
    return {device: buf for (name, device), buf in _BUFFERS.items() if name == purpose}


def release_scratch(purpose: str | None = None) -> None:
    """Forget the buffers for ``purpose`` (all of them with None); the next call reallocates.

    Only safe while no captured CUDA graph still replays on a released buffer.
    """
    for key in [k for k in _BUFFERS if purpose is None or k[0] == purpose]:
        del _BUFFERS[key]
