"""4-bit weights (ember.quantization.int4_common) and their kernels (ember.kernels.int4_gemv,
int4_mma, int4_dequant) against independent unpackings of the published layouts and a float
reference.

The packers are checked against the formats' documented bit orders, written here a second way
(per nibble with numpy): AWQ puts column 8c + j of a pack at bit 4 * [0, 4, 1, 5, 2, 6, 3, 7][j]
(AutoAWQ's order_map [0, 2, 4, 6, 1, 3, 5, 7] inverted), GPTQ puts row 8r + i at bit 4i and its
v1 qzeros hold z - 1. Without CUDA the kernels run under TRITON_INTERPRET=1 at small shapes; the
``gpu`` cases run Llama-3.1-8B's projection shapes in bf16.
"""

from __future__ import annotations

import functools
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from ember.kernels.int4_dequant import int4_dequantize  # noqa: E402
from ember.kernels.int4_gemv import (  # noqa: E402
    MAX_ROWS,
    _resolved_config,
    int4_gemv,
    int4_gemv_config,
    row_sub_tile,
)
from ember.kernels.int4_mma import int4_mma, int4_mma_supported  # noqa: E402
from ember.kernels.tuning import (  # noqa: E402
    DeviceTuning,
    Int4GemvConfig,
    LinearRule,
    default_tuning,
)
from ember.quantization.int4_common import (  # noqa: E402
    AWQ_ORDER,
    awq_to_int4,
    dequantize_awq,
    dequantize_int4,
    dequantize_packed,
    gptq_to_int4,
    pack_int4,
    quantize_int4,
    unpack_int4,
)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
AWQ_BIT_OF_COLUMN = [0, 16, 4, 20, 8, 24, 12, 28]


def _np_unpack_awq(packed: torch.Tensor) -> np.ndarray:
    p = packed.numpy().view(np.uint32)
    out = np.zeros((p.shape[0], p.shape[1] * 8), dtype=np.int64)
    for j, bit in enumerate(AWQ_BIT_OF_COLUMN):
        out[:, j::8] = (p >> np.uint32(bit)) & 0xF
    return out


def _np_unpack_gptq_rows(packed: torch.Tensor) -> np.ndarray:
    p = packed.numpy().view(np.uint32)
    out = np.zeros((p.shape[0] * 8, p.shape[1]), dtype=np.int64)
    for i in range(8):
        out[i::8, :] = (p >> np.uint32(4 * i)) & 0xF
    return out


def _np_unpack_ember(packed: torch.Tensor) -> np.ndarray:
    """ember's in-memory qweight [N, K/8] -> q [K, N]: rows 2s and 2s + 1 of pack r at bits 4s
    and 16 + 4s (the bit of row j is AWQ's bit of column j)."""
    p = packed.numpy().view(np.uint32)
    out = np.zeros((p.shape[1] * 8, p.shape[0]), dtype=np.int64)
    for j, bit in enumerate(AWQ_BIT_OF_COLUMN):
        out[j::8, :] = ((p >> np.uint32(bit)) & 0xF).T
    return out


def _np_unpack_gptq_cols(packed: torch.Tensor) -> np.ndarray:
    p = packed.numpy().view(np.uint32)
    out = np.zeros((p.shape[0], p.shape[1] * 8), dtype=np.int64)
    for i in range(8):
        out[:, i::8] = (p >> np.uint32(4 * i)) & 0xF
    return out


def test_packers_follow_the_documented_bit_orders():
    gen = torch.Generator().manual_seed(0)
    values = torch.randint(0, 16, (24, 40), generator=gen, dtype=torch.int32)
    awq = pack_int4(values, 1, AWQ_ORDER)
    assert awq.shape == (24, 5) and awq.dtype == torch.int32
    np.testing.assert_array_equal(_np_unpack_awq(awq), values.numpy())
    rows = pack_int4(values, 0)
    assert rows.shape == (3, 40)
    np.testing.assert_array_equal(_np_unpack_gptq_rows(rows), values.numpy())
    np.testing.assert_array_equal(_np_unpack_gptq_cols(pack_int4(values, 1)), values.numpy())
    for dim, order in ((1, AWQ_ORDER), (0, tuple(range(8))), (1, tuple(range(8)))):
        assert torch.equal(unpack_int4(pack_int4(values, dim, order), dim, order), values)
    with pytest.raises(ValueError, match="0..15"):
        pack_int4(values + 1, 1)


def _gptq_checkpoint(k: int, n: int, group: int, desc_act: bool, seed: int = 0):
    """GPTQ v1 tensors of a random weight, and its float dequantization computed from the
    integers directly (not through ember's unpacking)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (k, n), generator=gen, dtype=torch.int32)
    z = torch.randint(0, 16, (k // group, n), generator=gen, dtype=torch.int32)
    s = torch.rand(k // group, n, generator=gen) * 0.02 + 0.001
    g_idx = torch.arange(k) // group
    if desc_act:
        g_idx = g_idx[torch.randperm(k, generator=gen)]
    w = (q - z[g_idx]).float() * s[g_idx]
    return pack_int4(q, 0), pack_int4((z - 1) & 0xF, 1), s, g_idx.to(torch.int32), w, q


@pytest.mark.parametrize("desc_act", [False, True])
def test_gptq_repacks_to_the_same_weight(desc_act):
    qweight, qzeros, scales, g_idx, want, q = _gptq_checkpoint(64, 24, 16, desc_act)
    weight = gptq_to_int4(qweight, qzeros, scales, g_idx, 16, 1, "layer")
    assert (weight.perm is not None) == desc_act
    assert weight.qweight.shape == (24, 8)
    rows = q.numpy() if not desc_act else q.numpy()[weight.perm.numpy()]  # in group order
    np.testing.assert_array_equal(_np_unpack_ember(weight.qweight), rows)
    torch.testing.assert_close(dequantize_int4(weight), want, rtol=0, atol=0)


def test_gptq_groups_that_cannot_be_sorted_are_refused():
    qweight, qzeros, scales, g_idx, _, _ = _gptq_checkpoint(64, 8, 16, False)
    g_idx[0] = 1  # group 1 now has 17 rows
    with pytest.raises(ValueError, match="layer.*g_idx"):
        gptq_to_int4(qweight, qzeros, scales, g_idx, 16, 1, "layer")


def test_awq_repacks_to_the_column_major_form():
    """AWQ's column-packed tensors repacked: each pack holds eight consecutive rows of one
    column in pair order (ember.quantization.int4_common) and the weight dequantizes to the
    same values."""
    gen = torch.Generator().manual_seed(2)
    q = torch.randint(0, 16, (64, 24), generator=gen, dtype=torch.int32)
    z = torch.randint(0, 16, (4, 24), generator=gen, dtype=torch.int32)
    s = torch.rand(4, 24, generator=gen) + 0.1
    qw, qz = pack_int4(q, 1, AWQ_ORDER), pack_int4(z, 1, AWQ_ORDER)
    weight = awq_to_int4(qw, qz, s, 16)
    assert weight.qweight.shape == (24, 8) and weight.qzeros.shape == (4, 3)
    np.testing.assert_array_equal(_np_unpack_ember(weight.qweight), q.numpy())
    np.testing.assert_array_equal(_np_unpack_gptq_cols(weight.qzeros), z.numpy())
    torch.testing.assert_close(dequantize_int4(weight), dequantize_awq(qw, qz, s, 16),
                               rtol=0, atol=0)


def _awq_case(k: int, n: int, group: int, dtype: torch.dtype, seed: int = 0):
    """An AWQ checkpoint weight in ember's form (qweight, qzeros, scales) and its float32
    dequantization computed from the AWQ tensors."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(k, n, generator=gen) / k**0.5
    q, z, s = quantize_int4(w, group)
    qw, qz = pack_int4(q, 1, AWQ_ORDER), pack_int4(z, 1, AWQ_ORDER)
    s = s.to(dtype)
    ref = dequantize_awq(qw, qz, s, group)  # from the scales as stored
    weight = awq_to_int4(qw, qz, s, group)
    return weight.qweight.to(DEV), weight.qzeros.to(DEV), weight.scales.to(DEV), ref.to(DEV)


def _check(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4)
    else:  # fp32 accumulation, one rounding of each output
        scale = want.abs().amax().item()
        torch.testing.assert_close(got.float(), want, atol=4e-3 * scale, rtol=1e-2)


def _x(m: int, k: int, dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(dtype).to(DEV)


# bf16 is not computed under the interpreter (no numpy bf16): fp16 stands for half precision.
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n,k,group,config,bias", [
    (40, 128, 32, None, False),  # N not a multiple of the tile; the tuned tiles
    (64, 256, 64, (32, 64, 2, 4, 1), True),  # K split in two
    (48, 96, 96, (32, 32, 2, 4, 1), False),  # one group over all of K, the last tile short
    (24, 1536, 128, None, False),  # the second K step half past K
    (32, 96, 48, (16, 64, 1, 4, 1), False),  # groups of 48: sub-tiles of 16
])
def test_int4_gemv(dtype, n, k, group, config, bias):
    qw, qz, s, w = _awq_case(k, n, group, dtype)
    x = _x(1, k, dtype)
    b = torch.randn(n).to(dtype).to(DEV) if bias else None
    got = int4_gemv(x, qw, qz, s, group, b, config=config)
    want = x.float() @ w + (b.float() if bias else 0.0)
    _check(got, want, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m,n,k,group,config", [
    (2, 40, 256, 32, None),  # the tuned tiles
    (3, 64, 512, 128, (32, 128, 2, 4, 1)),  # K split: the merge stores three rows' partials
    (4, 32, 96, 48, (16, 64, 1, 4, 1)),  # groups of 48, the last tile short
])
def test_int4_gemv_rows(dtype, m, n, k, group, config):
    """2-4 rows in one launch (each tile unpacked once for all): every row bit for bit the
    one-row launch of the same tiles, and the reference within the one-row bounds."""
    qw, qz, s, w = _awq_case(k, n, group, dtype)
    x = _x(m, k, dtype)
    b = torch.randn(n).to(dtype).to(DEV)
    got = int4_gemv(x, qw, qz, s, group, b, config=config)
    _check(got, x.float() @ w + b.float(), dtype)
    # The one-row launch compared against must use the rows' tiles: a device's tuned one-row
    # tiles differ, and a different K split sums in another order.
    config = config or int4_gemv_config(n, k, x.device, rows=m)
    for row in range(m):
        assert torch.equal(got[row], int4_gemv(x[row:row + 1], qw, qz, s, group, b,
                                               config=config)[0])
    # A row view with a stride past K (a slice of a wider tensor) reads the same.
    wide = torch.zeros(m, k + 2, dtype=dtype, device=DEV)
    wide[:, :k] = x
    assert torch.equal(int4_gemv(wide[:, :k], qw, qz, s, group, b, config=config), got)


@pytest.mark.parametrize("m,n,k,group,block_n,split_k,bias,block_m", [
    (1, 64, 256, 128, 64, 1, True, 0),  # one row, two tiles of K
    (3, 200, 512, 128, 64, 2, False, 0),  # N not a multiple of the tile; K split in two
    (16, 136, 384, 384, 64, 3, True, 0),  # 16 rows; one group over all of K; three splits
    (5, 128, 1024, 256, 128, 0, False, 0),  # groups of two tiles; the automatic split
    (40, 64, 256, 128, 64, 2, True, 16),  # three tiles of rows, each merging its K splits
    (70, 128, 256, 128, 64, 1, False, 64),  # 64 rows a program, the second tile short
])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_int4_mma(m, n, k, group, block_n, split_k, bias, block_m, dtype):
    """The tensor-core kernel (under the interpreter its integer twin) against the float
    reference, with the one-rounding bound of the GEMV."""
    qw, qz, s, w = _awq_case(k, n, group, torch.float16)
    x = _x(m, k, dtype)
    b = torch.randn(n).to(dtype).to(DEV) if bias else None
    got = int4_mma(x, qw, qz, s, group, b, block_n=block_n, split_k=split_k, block_m=block_m)
    _check(got, x.float() @ w + (b.float() if bias else 0.0), dtype)
    # A row view with a stride past K (a slice of a wider tensor) reads the same.
    wide = torch.zeros(m, k + 8, dtype=dtype, device=DEV)
    wide[:, :k] = x
    assert torch.equal(int4_mma(wide[:, :k], qw, qz, s, group, b, block_n=block_n,
                                split_k=split_k, block_m=block_m), got)


def test_int4_mma_takes_whole_tiles_inside_groups():
    assert int4_mma_supported(4096, 128) and int4_mma_supported(4096, 4096)
    assert not int4_mma_supported(4096, 64)  # a 128-row tile would straddle two groups
    assert not int4_mma_supported(96, 96)  # not whole tiles


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n,k,group", [(40, 128, 32), (24, 96, 96), (64, 512, 128), (16, 96, 48)])
def test_int4_dequantize_equals_the_reference(dtype, n, k, group):
    """The dense weight the layer hands cuBLAS above 16 rows: bit for bit the reference
    dequantization (float32, rounded once to the dtype), [N, K] as F.linear takes it."""
    qw, qz, s, w = _awq_case(k, n, group, dtype)
    got = int4_dequantize(qw, qz, s, group, dtype)
    want = dequantize_packed(qw.cpu(), qz.cpu(), s.cpu(), group).t().to(dtype)
    assert got.shape == (n, k) and got.dtype == dtype
    assert torch.equal(got.cpu(), want)
    torch.testing.assert_close(got.float(), w.t(), rtol=0, atol=1e-2 if dtype != torch.float32
                               else 0)


def test_gemv_config_splits_small_grids():
    tuning = default_tuning()
    for n, k in [(2048, 14336), (1024, 4096), (4096, 4096), (28672, 4096)]:
        config = _resolved_config(tuning, n, k, 132)
        tiles = -(-n // config.block_n)
        # The entry's programs an SM, or every split at least two steps of K.
        assert (tiles * config.split_k >= config.programs_per_sm * 132
                or config.split_k == -(-k // (2 * config.block_k))), (n, k, config)
    assert _resolved_config(tuning, 6144, 4096, 132).split_k == 1  # enough tiles: unsplit
    # A table entry with its own split keeps it.
    fixed = DeviceTuning({}, {}, {}, {}, (), int4_gemv=(LinearRule(Int4GemvConfig(16, 512, 3)),))
    assert _resolved_config(fixed, 4096, 4096, 132).split_k == 3
    # Sub-tiles stay inside a group: powers of two dividing it.
    assert [row_sub_tile(g, 1024) for g in (128, 96, 4096, 11008, 24)] == [128, 32, 1024, 256, 8]


LLAMA8B = [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)]  # (in, out)


@functools.cache
def _llama8b_case(k: int, n: int):
    """_awq_case of one Llama-8B shape, made once for all its row counts (quantizing and packing
    a 28672 x 4096 weight on the host takes seconds; the cases only read it)."""
    return _awq_case(k, n, 128, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("k,n", LLAMA8B)
@pytest.mark.parametrize("m", [1, 3, 4, 16, 64, 256])
def test_int4_kernels_llama8b_shapes_bf16(k, n, m):
    qw, qz, s, w = _llama8b_case(k, n)
    x = _x(m, k, torch.bfloat16)
    want = x.float() @ w
    if m <= 64:
        _check(int4_mma(x, qw, qz, s, 128), want, torch.bfloat16)
        _check(int4_mma(x, qw, qz, s, 128, block_n=256, split_k=1), want, torch.bfloat16)
        _check(int4_mma(x.half(), qw, qz, s, 128), want, torch.float16)  # bf16 values: exact
    if m <= MAX_ROWS:
        _check(int4_gemv(x, qw, qz, s, 128), want, torch.bfloat16)
        _check(int4_gemv(x, qw, qz, s, 128, config=(64, 128, 2, 4, 1)), want, torch.bfloat16)
    _check(F.linear(x, int4_dequantize(qw, qz, s, 128, x.dtype)), want, torch.bfloat16)


_SM90_HEADER = r'''
import re
import torch
from sm90_launch import compile_as_launched
from ember.kernels import int4_gemv, int4_mma


def random_int4(k, n):
    """qweight, qzeros, scales of a random [k, n] 4-bit weight in ember's form."""
    qw = torch.randint(0, 2**31 - 1, (n, k // 8), dtype=torch.int32)
    qz = torch.randint(0, 2**31 - 1, (k // 128, n // 8), dtype=torch.int32)
    return qw, qz, torch.rand(k // 128, n).half()
'''

_SM90_SCRIPT = _SM90_HEADER + r'''
# qkv and o take 16-byte pack loads in the H200's table, down 8-byte ones.
for k, n in [(4096, 6144), (4096, 4096), (14336, 4096)]:
    x = torch.randn(1, k).bfloat16()
    qw, qz, s = random_int4(k, n)
    (consts, ptx), = compile_as_launched(int4_gemv, "_int4_gemv_kernel",
                                         lambda: int4_gemv.int4_gemv(x, qw, qz, s, 128))
    assert consts["X_WORDS"] and consts["PACKED_HALF"], consts
    wide = bool(re.search(r"ld\.global[.\w]*\.v4\.b32", ptx))
    assert wide == consts["WIDE_LOADS"], (k, n, "16-byte pack loads", wide)
    assert wide or re.search(r"ld\.global[.\w]*\.v2\.b32", ptx), (k, n, "no 8-byte loads")
    assert "ld.local" not in ptx and "st.local" not in ptx, (k, n, "registers spilled")
    assert len(re.findall(r"lop3\.b32", ptx)) >= 4, (k, n, "no pair unpacking")
    # Four rows: each pack unpacked once (as many lop3 as one row's kernel of the same tiles).
    one_row_lop3 = len(re.findall(r"lop3\.b32", ptx))
    (consts, ptx), = compile_as_launched(
        int4_gemv, "_int4_gemv_kernel",
        lambda: int4_gemv.int4_gemv(torch.randn(4, k).bfloat16(), qw, qz, s, 128,
                                    config=int4_gemv.int4_gemv_config(n, k, x.device)))
    assert consts["ROWS"] == 4 and consts["X_WORDS"], consts
    assert "ld.local" not in ptx and "st.local" not in ptx, (k, n, "4 rows: registers spilled")
    assert len(re.findall(r"lop3\.b32", ptx)) == one_row_lop3, (k, n, "4 rows: lop3 repeated")
print("ok")
'''


@pytest.mark.slow
def test_int4_gemv_compiles_to_wide_loads_for_sm90():
    """Without a GPU: at Llama-8B's shapes with the tuned tiles, launched as int4_gemv launches
    it (tests/sm90_launch.py), the one-row kernel compiles for sm90 to 16-byte loads of the
    packs where its table asks for them (the offsets provably aligned: K / 8 passed in, whole
    steps per split) and 8-byte ones elsewhere, the pair unpacking in lop3 and no register
    spills. Run in a fresh interpreter (this process may
    have TRITON_INTERPRET set)."""
    from conftest import run_sm90_script

    proc = run_sm90_script(_SM90_SCRIPT)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


_SM90_MMA_SCRIPT = _SM90_HEADER + r'''
# qkv (128 columns a program) and down (256): the weight operand is unpacked in the wgmma's
# register layout (no trip through shared memory by the threads: the only shared stores are
# the pipeline's cp.async copies), four lop3 a pack, eight dots a tile per 64 columns.
for k, n, dtype in [(4096, 6144, torch.bfloat16), (14336, 4096, torch.bfloat16),
                    (4096, 6144, torch.float16)]:
    x = torch.randn(4, k).to(dtype)
    qw, qz, s = random_int4(k, n)
    (consts, ptx), = compile_as_launched(int4_mma, "_int4_mma_kernel",
                                         lambda: int4_mma.int4_mma(x, qw, qz, s, 128))
    block_n = consts["BLOCK_N"]
    assert consts["ON_GPU"] and block_n == int4_mma.default_block_n(k), consts
    dots = re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n16k16\.f32\.bf16\.bf16", ptx)
    assert len(dots) == 8 * block_n // 64, (k, n, len(dots))
    assert len(re.findall(r"st\.shared", ptx)) <= 2, (k, n, "weight staged through shared")
    assert len(re.findall(r"lop3\.b32", ptx)) == block_n * 128 // (32 * 4) // 8 * 4, (k, n)
    assert "ld.local" not in ptx and "st.local" not in ptx, (k, n, "registers spilled")
print("ok")
'''


@pytest.mark.slow
def test_int4_mma_compiles_to_register_operands_for_sm90():
    """Without a GPU: int4_mma compiled for sm90 as launched at Llama-8B's qkv and down keeps
    its unpacked weight in the wgmma's registers (the design's point: Triton hoists the
    unpacking, a pure elementwise asm, to the packs' load from shared memory). Run in a fresh
    interpreter."""
    from conftest import run_sm90_script

    proc = run_sm90_script(_SM90_MMA_SCRIPT)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]
