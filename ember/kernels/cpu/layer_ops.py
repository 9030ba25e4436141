"""layer_ops: a decoder layer's small ops on the CPU in float32 as single native calls (RMSNorm
with or without the residual add, rotary in place, SiLU-and-mul, the KV-cache store and decode
attention read straight from the paged cache). A small model's CPU decode step is bound by the
number of torch calls (each RMSNorm is ~10 torch ops, each decode attention a gather, a mask and
SDPA); these make each one call.

Used by the layers (``takes``) on CPU float32 tensors outside torch.compile, where
``KernelConfig.cpu_layers`` is on (the default) and the library builds (layer_ops.c, built as
ember.kernels.cpu.native builds every CPU kernel). Rotary equals torch's ops bit for bit; the
norm, SiLU and attention agree to rounding (their sums run in another order), so a float32
model's logits are no longer HF's bit for bit, only to rounding: ``KernelConfig(cpu_layers=
False)`` keeps the torch ops.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from ember.kernels.config import kernel_config
from ember.kernels.cpu import native

_FLAGS = ("-ffp-contract=off", "-fno-math-errno", "-lm")
_P, _I64, _F, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
_SIGNATURES: native.Signatures = {
    "ember_rms_norm": (None, [_P, _I64, _I64, _I64, _P, _I64, _P, _P, _I64, _I64, _I64, _F, _INT]),
    "ember_rotary": (None, [_P, _I64, _I64, _P, _I64, _I64, _I64, _I64, _I64, _P, _P, _INT]),
    "ember_silu_and_mul": (None, [_P, _I64, _P, _I64, _I64, _I64, _INT]),
    "ember_store_kv": (None, [_P, _I64, _P, _I64, _P, _I64, _P, _I64, _I64]),
    "ember_embedding": (None, [_P, _I64, _I64, _P, _I64, _P]),
    "ember_cos_sin": (None, [_P, _I64, _P, _I64, _F, _P, _P]),
    "ember_decode_attention": (_INT, [_P, _I64, _P, _I64, _P, _I64, _P, _I64, _P, _I64, _I64,
                                      _P, _I64, _P, _P, _I64, _I64, _I64, _I64, _F, _I64, _F,
                                      _INT]),
}


@functools.cache
def library() -> ctypes.CDLL | None:
    """The built library, or None (logged once) where it cannot be built."""
    return native.load("layer_ops.c", _SIGNATURES, _FLAGS, "torch's ops are used")


def configured() -> bool:
    """KernelConfig.cpu_layers: read by a layer as it is built (the library is built on the
    first call that needs it, so a model that never runs on the CPU never compiles it)."""
    return kernel_config().cpu_layers


def takes(x: torch.Tensor) -> bool:
    """Whether a layer built with ``configured()`` should run ``x`` through these ops: float32
    on the CPU, not traced, and the library builds."""
    return (x.dtype == torch.float32 and x.device.type == "cpu"
            and not torch.compiler.is_compiling() and library() is not None)


def rows_of(x: torch.Tensor) -> int | None:
    """The row stride of ``x`` seen as [rows, last dim] (the last dim contiguous, the rows
    evenly spaced), or None."""
    if x.stride(-1) != 1:
        return None
    if x.dim() == 1:
        return x.shape[0]
    if x.dim() == 2:
        return x.stride(0)
    # Leading dims that flatten into one evenly strided row axis.
    stride = x.stride(-2)
    expected = stride
    for size, st in zip(reversed(x.shape[:-1]), reversed(x.stride()[:-1]), strict=True):
        if size != 1 and st != expected:
            return None
        expected *= size
    return stride


def norm_rows(x: torch.Tensor) -> tuple[int, int, int] | None:
    """(row stride, rows per outer step, outer stride) of x seen as rows of its last dim: its
    ``rows_of`` rows, or the heads of a [tokens, heads, dim] view whose tokens are strided (the
    q and k of a fused qkv output); None for another layout."""
    stride = rows_of(x)
    if stride is not None:
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        return stride, max(rows, 1), 0
    if x.dim() == 3 and x.stride(2) == 1:
        return x.stride(1), max(x.shape[1], 1), x.stride(0)
    return None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor:
    """weight * (h * rsqrt(mean(h^2) + eps)) with h = x, or x + residual (then written into x,
    as ``x.add_(residual)`` would), as a new contiguous tensor. x must have ``norm_rows``
    strides, a residual ``rows_of`` strides and x's shape (x then has ``rows_of`` strides)."""
    dim = x.shape[-1]
    rows = x.numel() // dim if dim else 0
    out = torch.empty(x.shape, dtype=torch.float32)
    if rows:
        row_stride, inner, outer_stride = norm_rows(x)
        res_ptr, res_stride = (None, 0) if residual is None else (
            residual.data_ptr(), rows_of(residual))
        native.call(library().ember_rms_norm,
                    (x.data_ptr(), row_stride, inner, outer_stride, res_ptr, res_stride,
                     weight.data_ptr(), out.data_ptr(), dim, rows, dim, eps,
                     torch.get_num_threads()),
                    (x, residual, weight, out))
    return out


def rotary_inplace(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   rotary_dim: int) -> None:
    """Rotate q [T, q_heads, head_size] and k [T, k_heads, head_size] (``rotary_fits``) in
    place; cos/sin hold [T, rotary_dim / 2] contiguous values."""
    t, q_heads, head_size = q.shape
    if t:
        native.call(library().ember_rotary,
                    (q.data_ptr(), q.stride(0), q_heads, k.data_ptr(), k.stride(0), k.shape[1],
                     t, head_size, rotary_dim, cos.data_ptr(), sin.data_ptr(),
                     torch.get_num_threads()),
                    (q, k, cos, sin))


def heads_contiguous(x: torch.Tensor) -> bool:
    """x [tokens, heads, D] with each token's heads side by side (its rows may be strided):
    the layout rotary and the attention ops take."""
    return x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2]


def rotary_fits(x: torch.Tensor, cos: torch.Tensor) -> bool:
    """Whether ``rotary_inplace`` takes x [T, heads, head_size] with cos [T, 1, half]."""
    return heads_contiguous(x) and cos.dtype == torch.float32 and cos.is_contiguous()


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(x[..., :d]) * x[..., d:] for x of width 2d with ``rows_of`` strides."""
    d = x.shape[-1] // 2
    out = torch.empty((*x.shape[:-1], d), dtype=torch.float32)
    rows = out.numel() // d if d else 0
    if rows:
        native.call(library().ember_silu_and_mul,
                    (x.data_ptr(), rows_of(x), out.data_ptr(), d, rows, d,
                     torch.get_num_threads()),
                    (x, out))
    return out


def embedding(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """weight[ids] for int64 ids [T] and a contiguous float32 weight [vocab, dim]."""
    rows = ids.shape[0]
    vocab, dim = weight.shape
    out = torch.empty((rows, dim), dtype=torch.float32)
    if rows:
        native.call(library().ember_embedding,
                    (weight.data_ptr(), vocab, dim, ids.data_ptr(), rows, out.data_ptr()),
                    (weight, ids, out))
    return out


def cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor,
            scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [T, 1, half] of positions (int64, contiguous) times inv_freq [half]
    (float32), times ``scaling``: RotaryEmbedding.cos_sin's values to rounding."""
    tokens, half = positions.shape[0], inv_freq.shape[0]
    cos = torch.empty((tokens, 1, half), dtype=torch.float32)
    sin = torch.empty((tokens, 1, half), dtype=torch.float32)
    if tokens:
        native.call(library().ember_cos_sin,
                    (positions.data_ptr(), tokens, inv_freq.data_ptr(), half, scaling,
                     cos.data_ptr(), sin.data_ptr()),
                    (positions, inv_freq, cos, sin))
    return cos, sin


def store_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
             slots: torch.Tensor) -> None:
    """key/value [n, kv_heads, D] rows into kv_cache [2, blocks, block_size, kv_heads, D]
    (contiguous float32) at ``slots`` (int64, contiguous; < 0 = skip)."""
    n = slots.shape[0]
    if n:
        width = kv_cache.shape[3] * kv_cache.shape[4]
        native.call(library().ember_store_kv,
                    (key.data_ptr(), key.stride(0), value.data_ptr(), value.stride(0),
                     kv_cache.data_ptr(), kv_cache.shape[1] * kv_cache.shape[2],
                     slots.data_ptr(), n, width),
                    (key, value, kv_cache, slots))


def decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                     seq_lens: torch.Tensor, out: torch.Tensor, scale: float,
                     window: int | None, soft_cap: float | None,
                     store: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> None:
    """One query per request: q [reqs, q_heads, D] (heads contiguous) attends to its request's
    ``seq_lens`` keys through ``block_table`` (int32); writes out [reqs, q_heads * D]
    (contiguous rows). ``store`` = (key, value, slots): ``store_kv`` first, in the same call."""
    reqs, q_heads, d = q.shape
    _, num_blocks, block_size, kv_heads, _ = kv_cache.shape
    if store is None:
        key_ptr = k_stride = value_ptr = v_stride = slots_ptr = n_store = 0
        store = ()
    else:
        key, value, slots = store
        key_ptr, k_stride, value_ptr, v_stride = (key.data_ptr(), key.stride(0),
                                                  value.data_ptr(), value.stride(0))
        slots_ptr, n_store = slots.data_ptr(), slots.shape[0]
    status = native.call(
        library().ember_decode_attention,
        (key_ptr, k_stride, value_ptr, v_stride, slots_ptr, n_store,
         q.data_ptr(), q.stride(0), kv_cache.data_ptr(), num_blocks, block_size,
         block_table.data_ptr(), block_table.stride(0), seq_lens.data_ptr(), out.data_ptr(),
         reqs, q_heads, kv_heads, d, scale, window or 0, soft_cap or 0.0,
         torch.get_num_threads()),
        (q, kv_cache, block_table, seq_lens, out, *store))
    if status:
        raise MemoryError("decode_attention: out of memory for its scores")
