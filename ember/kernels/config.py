"""KernelConfig: the one switchable part of how ember runs its kernels, set once per process.

The defaults are what ember ships: the layers' Triton kernels on CUDA in half precision and
programmatic dependent launch on sm90+ GPUs. Turning one off exists to compare against the plain
path (tests, benchmarks) and to rule a kernel out while debugging; it is not a tuning knob.
Layers read the config as they are built, launches read ``pdl`` as they are made; nothing reads
the environment. Set it before building an engine::

    from ember.kernels import KernelConfig, set_kernel_config
    set_kernel_config(KernelConfig(pdl=False))
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class KernelConfig:
    # RMSNorm (+ residual), rotary, SiLU-and-mul, greedy argmax and the small-batch linear
    # kernel replace the torch ops on CUDA in float16/bfloat16 (the torch ops run elsewhere).
    triton_layers: bool = True
    # Programmatic dependent launch of ember's kernels on sm90+ (see launch.pdl_options).
    pdl: bool = True
    # RMSNorm and SiLU-and-mul write their output already quantized when the linear layer
    # after them computes on quantized activations (fp8: LinearMethod.quantized_input_dtype),
    # instead of that layer quantizing it again.
    quantized_producers: bool = True
    # fp8 GEMMs above the small-batch rows (torch._scaled_mm) accumulate in the tensor cores'
    # fast mode, without promoting partial sums to float32 every few K steps, as vLLM's
    # CUTLASS fp8 kernels for sm90 do (its FP8FastAccum schedules).
    fp8_fast_accumulation: bool = True
    # RMSNorm, rotary, SiLU-and-mul, the KV store and decode attention run as native calls on
    # the CPU in float32 (ember.kernels.cpu.layer_ops), agreeing with the torch ops to rounding;
    # off, the torch ops (bit for bit HF transformers' float32 arithmetic).
    cpu_layers: bool = True
    # 4-bit (AWQ / GPTQ) layers of 3-64 half-precision rows multiply on the tensor cores
    # (int4_mma); off, the CUDA-core GEMV up to 4 rows (int4_gemv) and the dequantized weight
    # above.
    int4_tensor_cores: bool = True
    # 4-bit layers of 1-2 half-precision rows (decoding one or two sequences) take their input
    # quantized to int8 by the kernel that writes it (RMSNorm, SiLU-and-mul; one scale per 128
    # columns, ember.kernels.int8_act) and multiply in integer dot products (w4a8_gemv); off,
    # the input stays in half precision (int4_gemv), as vLLM's AWQ layers keep it: the int8
    # rounding moves outputs by ~0.3% of their largest value (docs/benchmarks.md).
    int4_int8_activations: bool = True
    # Decoding one or two sequences, a 4-bit or fp8 o_proj's weight and the next layer's qkv
    # are read into L2 on a side stream during attention, whose short kernels leave the memory
    # idle (ember.layers.weight_prefetch).
    l2_prefetch: bool = False
    # The attention backend rotates q and k as it attends where it can
    # (AttentionImpl.fuses_rotary: the triton backend's decode kernel), one kernel fewer a layer
    # in a decode step; off, the rotary kernel rotates them first. Off until measured on a GPU.
    rotary_in_attention: bool = False


_current = KernelConfig()


def kernel_config() -> KernelConfig:
    """The process's kernel configuration."""
    return _current


def set_kernel_config(config: KernelConfig) -> KernelConfig:
    """Replace the process's kernel configuration (layers built before keep their choice);
    returns the previous one."""
    global _current
    previous, _current = _current, config
    return previous


@contextlib.contextmanager
def use_kernel_config(config: KernelConfig) -> Iterator[KernelConfig]:
    """``config`` for the duration of the block (tests and benchmarks that compare paths)."""
    previous = set_kernel_config(config)
    try:
        yield config
    finally:
        set_kernel_config(previous)
