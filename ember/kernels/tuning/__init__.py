"""Tuned launch configurations of the kernels, as data keyed by device.

The types of the tables (``DecodeConfig``, ``PrefillConfig``, ``SmallBatchLinearConfig``,
``Fp8GemvConfig``, ``Int4GemvConfig`` and ``LinearRule``, the shape rules that pick the linear
kernels' tiles) and ``DeviceTuning``, one set of tables per device. A device module
(``nvidia_h200``) holds one ``DeviceTuning``; ``tuning_for(device)`` returns the entry whose
key the CUDA device's name contains, and ``default_tuning()`` for every other device and for
the CPU interpreter: the H200's tables, the only device they were measured on. To tune a
device, run ``python -m ember.bench.attention_kernels``, ``decode_latency``,
``small_batch_linear`` (``--fp8`` for fp8_gemv) and ``quant kernels --sweep`` there, add a
module with its tables and name it in ``_device_tunings``.

Nothing here imports torch or triton except ``tuning_for`` (torch, for the device name).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class DecodeConfig:
    """Tiles and split policy of the decode attention kernel (ember.kernels.decode_attention)."""

    block_n: int = 64  # keys per tile; a multiple of the cache block size reads whole blocks
    num_warps: int = 4
    num_stages: int = 3
    # Programs resident per SM, for the no-split and the split kernel: splits are chosen so
    # that the last wave of programs is nearly full (a partial wave leaves HBM idle).
    direct_programs_per_sm: int = 4
    programs_per_sm: int = 3
    # Splits shorter than one tile are not worth their share of the reduce.
    min_split_tokens: int = 64
    max_splits: int = 64
    # With unknown lengths (a CUDA graph replays whatever lengths come), at most this many:
    # each split a short context leaves empty still launches and enters the reduce.
    graph_max_splits: int = 16


@dataclass(frozen=True)
class PrefillConfig:
    """Tiles of the prefill attention kernel (ember.kernels.prefill_attention)."""

    block_m: int = 64  # rows per program = query tokens x (padded) query heads of a kv group
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2


class SmallBatchLinearConfig(NamedTuple):
    """Tiles of ember.kernels.small_batch_linear: output features and K per step, K splits, K
    elements per weight row prefetched into L2 up front (compiled CUDA only), warps, and
    pipeline stages (Triton keeps num_stages - 1 weight tiles in flight)."""

    block_n: int
    block_k: int
    split_k: int = 1
    l2_prefetch: int = 0
    num_warps: int = 4
    num_stages: int = 4


class Fp8GemvConfig(NamedTuple):
    """Tiles of ember.kernels.fp8_gemv: output features (>= 64: wgmma's rows) and K per step,
    K splits (0: as many as fill the SMs), warps, and pipeline stages."""

    block_n: int
    block_k: int
    split_k: int = 0
    num_warps: int = 4
    num_stages: int = 4


class Int4GemvConfig(NamedTuple):
    """Tiles of ember.kernels.int4_gemv (1-4 rows, 4-bit weights): output columns and K rows per
    step, K splits (0: until the grid holds ``programs_per_sm`` programs per SM), warps,
    pipeline stages (the kernel double-buffers in registers itself: one), whether the pack
    offsets are hinted 16-byte aligned so each thread loads four packs an instruction instead
    of two (faster at some shapes, slower at others: measured per shape)."""

    block_n: int
    block_k: int
    split_k: int = 0
    num_warps: int = 4
    num_stages: int = 1
    wide_loads: bool = True
    programs_per_sm: int = 2


# Rows the small-batch linear kernel takes: they are padded to one tl.dot tile.
SMALL_BATCH_LINEAR_MAX_ROWS = 16


@dataclass(frozen=True)
class LinearRule:
    """``config`` (a linear kernel's tiles) for an [n, k] weight within these bounds (None:
    unbounded)."""

    config: SmallBatchLinearConfig | Fp8GemvConfig | Int4GemvConfig
    min_elements: int | None = None  # n * k > min_elements
    max_elements: int | None = None  # n * k < max_elements
    min_n: int | None = None  # n > min_n
    max_n: int | None = None  # n <= max_n
    min_k: int | None = None  # k >= min_k
    more_outputs_than_inputs: bool | None = None  # n > k

    def matches(self, n: int, k: int) -> bool:
        elements = n * k
        return ((self.min_elements is None or elements > self.min_elements)
                and (self.max_elements is None or elements < self.max_elements)
                and (self.min_n is None or n > self.min_n)
                and (self.max_n is None or n <= self.max_n)
                and (self.min_k is None or k >= self.min_k)
                and (self.more_outputs_than_inputs is None
                     or (n > k) == self.more_outputs_than_inputs))


# eq=False: hashed by identity, so a tuning can key the caches of the split choice.
@dataclass(frozen=True, eq=False)
class DeviceTuning:
    """One device's tables. Attention tables are keyed by the padded head size."""

    decode: Mapping[int, DecodeConfig]  # no-split launches: the batch alone fills the GPU
    decode_split: Mapping[int, DecodeConfig]  # split launches of several waves
    decode_latency: Mapping[int, DecodeConfig]  # split launches of at most one program per SM
    prefill: Mapping[int, PrefillConfig]
    # First matching rule wins; the last should match every shape.
    small_batch_linear: tuple[LinearRule, ...]
    fp8_gemv: tuple[LinearRule, ...] = ()
    # fp8_gemv given x already quantized (no quantization in the loop: other tiles win)
    fp8_gemv_quantized_x: tuple[LinearRule, ...] = ()
    int4_gemv: tuple[LinearRule, ...] = ()
    int4_gemv_rows: tuple[LinearRule, ...] = ()  # 2-4 rows (empty: the one-row rules)
    w4a8_gemv: tuple[LinearRule, ...] = ()  # int8 rows, one (empty: int4_gemv's one-row rules)
    w4a8_gemv_rows: tuple[LinearRule, ...] = ()  # 2-4 int8 rows (empty: the one-row rules)

    def linear_config(self, n: int, k: int) -> SmallBatchLinearConfig:
        for rule in self.small_batch_linear:
            if rule.matches(n, k):
                return rule.config
        return SmallBatchLinearConfig(32, 256)

    def fp8_gemv_config(self, n: int, k: int, quantized_x: bool = False) -> Fp8GemvConfig:
        for rule in self.fp8_gemv_quantized_x if quantized_x else self.fp8_gemv:
            if rule.matches(n, k):
                return rule.config
        return Fp8GemvConfig(64, 256)

    def int4_gemv_config(self, n: int, k: int, rows: int = 1) -> Int4GemvConfig:
        for rule in self.int4_gemv if rows == 1 else self.int4_gemv_rows or self.int4_gemv:
            if rule.matches(n, k):
                return rule.config
        return Int4GemvConfig(16, 1024)

    def w4a8_gemv_config(self, n: int, k: int, rows: int = 1) -> Int4GemvConfig:
        for rule in self.w4a8_gemv if rows == 1 else self.w4a8_gemv_rows or self.w4a8_gemv:
            if rule.matches(n, k):
                return rule.config
        return self.int4_gemv_config(n, k)


def _device_tunings() -> dict[str, DeviceTuning]:
    """Each device's tables by a part of its CUDA device name (the modules import this one)."""
    from ember.kernels.tuning import nvidia_h200

    return {"H200": nvidia_h200.TUNING}


@functools.cache
def default_tuning() -> DeviceTuning:
    from ember.kernels.tuning import nvidia_h200

    return nvidia_h200.TUNING


@functools.cache
def _tuning_for_cuda(index: int) -> DeviceTuning:
    import torch

    name = torch.cuda.get_device_name(index)
    for key, tuning in _device_tunings().items():
        if key in name:
            return tuning
    return default_tuning()


def tuning_for(device: torch.device | None) -> DeviceTuning:
    """The tables for ``device`` (a CUDA device by its name; anything else: the default)."""
    if device is None or device.type != "cuda":
        return default_tuning()
    if device.index is None:
        import torch

        return _tuning_for_cuda(torch.cuda.current_device())
    return _tuning_for_cuda(device.index)
