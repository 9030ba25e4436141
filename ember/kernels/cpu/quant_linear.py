"""quant_linear: a quantized linear layer on the CPU, 4- or 8-bit integer codes with one scale and
offset per 32 inputs (GGUF's Q4_0 / Q4_1 / Q4_K, and Q5_0 / Q5_1 / Q8_0 / Q5_K in 8 bits; the
logits head in 8 bits), y = x @ W^T in float32, x multiplied in bfloat16.

The kernel (quant_linear.c) widens each tile of 16 outputs to bfloat16 once and multiplies every
row with it, on AVX512-BF16's dot where the CPU has it, so a batch reuses each weight across its
rows, as torch's int4 and int8 matmuls do not (docs/benchmarks.md). Each row's sum runs in the
same order whatever the batch, so a token's result does not depend on what it was batched with.

Built on first use with the machine's C compiler (``CC``, else ``cc``; -O3 -march=native
-fopenmp) into ``EMBER_CACHE_DIR`` (a temporary directory when the cache is off), keyed by the
source, the flags and the CPU's feature flags; ``available()`` is False where it cannot be
built, and callers keep torch's int4 matmul. Under ``torch.compile`` (``compile_model=True``)
the call is the custom op ``ember::quant_linear`` (``quant_linear_op``), which dynamo keeps as
one opaque call instead of breaking the graph at a ctypes call; ``linear`` picks the op when
tracing and the plain call (no op dispatch) otherwise.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from ember.kernels.cpu import native

TILE, GROUP, HEADER_BYTES = 16, 32, 64
# The packed blocks' layout (``pack``), named in snapshot-cache keys: change it with the layout.
LAYOUT = "bf16-pairs"


def build(extra_flags: tuple[str, ...] = ()) -> str:
    """The shared library's path, compiled now unless cached (ember.kernels.cpu.native.build)."""
    return native.build("quant_linear.c", extra_flags)


_SIGNATURES: native.Signatures = {
    "ember_quant_linear": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                                          ctypes.c_int, ctypes.c_void_p, ctypes.c_int64,
                                          ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]),
    "ember_quant_native": (ctypes.c_int, []),
}


def _load(path: str) -> ctypes.CDLL:
    return native.open_library(path, _SIGNATURES)


@functools.cache
def library() -> ctypes.CDLL | None:
    """The built kernel, or None (logged once) where it cannot be built."""
    return native.load("quant_linear.c", _SIGNATURES,
                       fallback="torch's int4 and int8 matmuls are used")


def available() -> bool:
    return library() is not None


def native_bf16() -> bool:
    """Whether the kernel runs on AVX512-BF16 (else its plain-C build, much slower)."""
    lib = library()
    return bool(lib is not None and lib.ember_quant_native())


def pack(codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor,
         bits: int = 4) -> torch.Tensor | None:
    """The kernel's blocks for w = scale * code + offset: codes [N, K] (0..15 for 4 bits,
    -128..127 for 8), scale and offset [N, K / 32]. None where K is not a multiple of 32 or a
    scale or offset does not fit float16 (the kernel keeps them so)."""
    n, k = codes.shape
    if bits not in (4, 8) or k % GROUP or scale.shape != (n, k // GROUP) or offset.shape != scale.shape:
        return None
    half_d, half_m = scale.to(torch.float16), offset.to(torch.float16)
    if not (torch.isfinite(half_d).all() and torch.isfinite(half_m).all()):
        return None
    tiles, groups = -(-n // TILE), k // GROUP
    pad = tiles * TILE - n
    if bits == 4:
        c = torch.nn.functional.pad(codes.to(torch.uint8), (0, 0, 0, pad))
        c = c.view(tiles, TILE, groups, 8, 4).permute(0, 2, 3, 1, 4)  # [T, G, quad, n, input]
        low = c[..., 0:2].reshape(tiles, groups, 8, 2 * TILE)
        high = c[..., 2:4].reshape(tiles, groups, 8, 2 * TILE)
        packed_codes = (low | (high << 4)).reshape(tiles, groups, -1)
    else:
        c = torch.nn.functional.pad(codes.to(torch.int8), (0, 0, 0, pad))
        c = c.view(tiles, TILE, groups, GROUP // 2, 2).permute(0, 2, 3, 1, 4)  # [T, G, pair, n, 2]
        packed_codes = c.reshape(tiles, groups, -1).view(torch.uint8)

    def per_tile(t: torch.Tensor) -> torch.Tensor:
        t = torch.nn.functional.pad(t, (0, 0, 0, pad)).view(tiles, TILE, groups)
        return t.permute(0, 2, 1).contiguous().view(torch.uint8)  # [T, G, 32] bytes

    return torch.cat([per_tile(half_d), per_tile(half_m), packed_codes], dim=-1).contiguous()


def pack_symmetric_8bit(weight: torch.Tensor) -> torch.Tensor | None:
    """A float weight [N, K] in 8-bit codes with one float16 scale per 32 inputs (GGUF's Q8_0
    rounding: the scale is the group's largest magnitude / 127; a Q8_0 tensor's dequantized
    values give back its own codes and scales)."""
    n, k = weight.shape
    if k % GROUP:
        return None
    w = weight.float().view(n, k // GROUP, GROUP)
    scale = (w.abs().amax(-1) / 127.0).to(torch.float16).float()
    codes = torch.round(w / scale.clamp(min=torch.finfo(torch.float16).tiny)[..., None])
    codes = codes.clamp(-127, 127).to(torch.int8).view(n, k)
    return pack(codes, scale, torch.zeros_like(scale), bits=8)


def quant_linear(x: torch.Tensor, blocks: torch.Tensor, n: int, bits: int = 4,
                 threads: int | None = None, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """x [..., K] (float32; another float dtype is converted) times the packed weight:
    [..., n] float32."""
    lib = lib or library()
    if lib is None:
        raise RuntimeError("the native quantized CPU kernel is not available")
    # A decode step makes ~120 of these calls: the 2-D float32 case takes no extra torch call.
    k = x.shape[-1]
    if blocks.shape[1] * GROUP != k:
        raise ValueError(f"x has {k} features, the weight {blocks.shape[1] * GROUP}")
    flat = x if x.dim() == 2 else x.reshape(-1, k)
    if flat.dtype != torch.float32 or flat.stride(-1) != 1:
        flat = flat.to(torch.float32).contiguous()
    rows = flat.shape[0]
    y = torch.empty((rows, n), dtype=torch.float32)
    if rows:
        status = native.call(lib.ember_quant_linear,
                             (flat.data_ptr(), flat.stride(0), blocks.data_ptr(), bits,
                              y.data_ptr(), n, rows, n, k, threads or torch.get_num_threads()),
                             (flat, blocks, y))
        if status:
            raise MemoryError("quant_linear: out of memory for its buffers")
    return y if x.dim() == 2 else y.view(*x.shape[:-1], n)


def linear(x: torch.Tensor, blocks: torch.Tensor, n: int, bits: int) -> torch.Tensor:
    """``quant_linear`` for a model's forward: under ``torch.compile`` the custom op (which
    ``quant_linear_op()`` must have registered before tracing), otherwise the plain call."""
    if torch.compiler.is_compiling():
        return torch.ops.ember.quant_linear(x, blocks, n, bits)
    return quant_linear(x, blocks, n, bits)


@functools.cache
def quant_linear_op():  # type: ignore[no-untyped-def]
    """``ember::quant_linear(x, blocks, n, bits)``: ``quant_linear`` as a torch custom op, for
    traced code (registered on first use: registering costs tens of milliseconds)."""

    @torch.library.custom_op("ember::quant_linear", mutates_args=())
    def op(x: torch.Tensor, blocks: torch.Tensor, n: int, bits: int) -> torch.Tensor:
        return quant_linear(x, blocks, n, bits)

    @op.register_fake
    def _(x: torch.Tensor, blocks: torch.Tensor, n: int, bits: int) -> torch.Tensor:
        return x.new_empty(*x.shape[:-1], n, dtype=torch.float32)

    return op
