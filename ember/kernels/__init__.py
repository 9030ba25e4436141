"""ember's Triton kernels: one module per op, the one home of every kernel.

    store_kv            write new keys/values into the paged KV cache
    prefill_attention   paged attention for query chunks of any length
    decode_attention    split-KV paged attention for one query token per request
    rms_norm            RMSNorm, optionally with the residual add before it
    rotary              rotate_half rotary embedding of q and k, in place
    silu_and_mul        the SwiGLU gate of a fused gate_up projection
    argmax              greedy argmax of a few rows over vocabulary chunks
    small_batch_linear  weight-streaming linear layer for up to 16 rows
    fused_moe           mixture-of-experts routing, expert sort and grouped GEMMs
    moe_decode          the mixture-of-experts layer for one token: two kernels, no sort
    int4_mma            4-bit (AWQ/GPTQ) linear layer for a few rows (3-64) on the tensor cores
    int4_gemv           4-bit (AWQ/GPTQ) linear layer for 1-4 rows, weight streaming
    w4a8_gemv           4-bit (AWQ/GPTQ) linear layer for 1-4 int8 rows, in integer dot products
    int8_act            int8 activations in the 4-bit packs' order, for w4a8_gemv
    int4_dequant        4-bit (AWQ/GPTQ) weight written out dense, for cuBLAS above int4_mma's rows
    fp8_quant           dynamic per-token float8 quantization of activations (W8A8 layers)
    fp8_gemv            fp8 (W8A8) linear layer for up to 16 rows on fp8 tensor cores
    l2_prefetch         weights read into L2 ahead of their layer, while memory sits idle

Shared pieces: ``launch`` (grid arithmetic, SM count, programmatic dependent launch, merge
counters), ``buffers`` (persistent scratch buffers, one per purpose and device),
``attention_common`` (score scaling inside the attention kernels), ``decode_splits`` (split-KV
decode's configs, split counts and workspace, host-side), ``decode_merge`` (split-KV decode's
split plan and the merge of its splits), ``int4_tile`` (the 4-bit
GEMV's tiles), ``split_k`` (the linear kernels' in-kernel K-split merge), ``tuning`` (tuned
tile configurations per device, as data), ``config`` (``KernelConfig``: what stays switchable,
set once per process) and ``dispatch`` (whether a layer takes a kernel).

Convention: a kernel module imports triton at its top and defines its kernels with
``@triton.jit`` there. Nothing imports a kernel module until a kernel is about to launch: the
op modules are attributes of this package, loaded on first access (``kernels.rms_norm``), so
``import ember.kernels`` needs neither torch nor triton, CPU-only runs never import triton, and
a test can still choose TRITON_INTERPRET (which triton reads when a kernel is defined) after
importing the layers. Layers and attention backends import kernels; kernels import no layer or
backend.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from ember.kernels.config import KernelConfig, kernel_config, set_kernel_config, use_kernel_config

OPS = (
    "store_kv",
    "prefill_attention",
    "decode_attention",
    "rms_norm",
    "rotary",
    "silu_and_mul",
    "argmax",
    "small_batch_linear",
    "fused_moe",
    "moe_decode",
    "int4_mma",
    "int4_gemv",
    "w4a8_gemv",
    "int8_act",
    "int4_dequant",
    "fp8_quant",
    "fp8_gemv",
    "l2_prefetch",
)
_LAZY_MODULES = frozenset((*OPS, "decode_splits", "decode_merge", "launch", "fast_launch", "attention_common",
                           "int4_tile", "split_k", "buffers", "dispatch", "tuning"))

__all__ = ["OPS", "KernelConfig", "kernel_config", "set_kernel_config", "use_kernel_config"]


def __getattr__(name: str) -> ModuleType:
    # Only reached while the submodule is not imported yet; importing it sets the attribute.
    if name in _LAZY_MODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
