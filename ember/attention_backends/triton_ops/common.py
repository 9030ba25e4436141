"""Deprecated alias: the shared kernel pieces live in ember.kernels.launch and
ember.kernels.attention_common."""

from __future__ import annotations

import torch

from ember.kernels import launch
from ember.kernels.attention_common import LOG2E, NEG_BIG, scaled_scores
from ember.kernels.launch import dot_precision, head_pad

__all__ = ["LOG2E", "NEG_BIG", "device_index", "dot_precision", "head_pad", "num_sms",
           "scaled_scores"]


def num_sms(device_index: int | None) -> int:
    """SMs of CUDA device ``device_index`` (None: not a CUDA device)."""
    if device_index is None:
        return launch.num_sms(torch.device("cpu"))
    return launch.num_sms(torch.device("cuda", device_index))


def device_index(t: torch.Tensor) -> int | None:
    return launch.cuda_index(t.device) if t.device.type == "cuda" else None
