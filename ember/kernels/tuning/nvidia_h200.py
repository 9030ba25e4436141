"""Tuned tables for the NVIDIA H200 (bf16; measured with the ember.bench kernel benchmarks).

Why these shapes: the no-split decode path is bandwidth-bound and likes 16 KB K tiles in three
stages; split launches of several waves like fewer, longer-lived programs (32 KB tiles); split
launches of at most one program per SM are bound by each program's chain of dependent loads, so
smaller tiles shorten it. Head sizes 64 and 256 are scaled from 128 by bytes per tile. The
small-batch linear rules stream the largest weights (past 32 Mi elements, taken at batch 1
only) in 3-stage pipelines, give a few thousand outputs wide tiles in deep pipelines, and let
the small models' layers prefetch the start of each weight row into L2 while the kernel before
ends; few outputs over a long K split K in four.
"""

from __future__ import annotations

from ember.kernels.tuning import (
    DecodeConfig,
    DeviceTuning,
    Fp8GemvConfig,
    Int4GemvConfig,
    LinearRule,
    PrefillConfig,
    SmallBatchLinearConfig,
)

_LARGE = 32 * 2**20  # weight elements past which a layer takes the kernel at batch 1 only

TUNING = DeviceTuning(
    decode={
        64: DecodeConfig(block_n=128, num_warps=4, num_stages=3),
        128: DecodeConfig(block_n=64, num_warps=4, num_stages=3),
        256: DecodeConfig(block_n=32, num_warps=4, num_stages=3),
    },
    decode_split={
        64: DecodeConfig(block_n=256, num_warps=4, num_stages=2),
        128: DecodeConfig(block_n=128, num_warps=4, num_stages=2),
        256: DecodeConfig(block_n=64, num_warps=4, num_stages=2),
    },
    decode_latency={
        64: DecodeConfig(block_n=64, num_warps=4, num_stages=2),
        128: DecodeConfig(block_n=64, num_warps=4, num_stages=2),
        256: DecodeConfig(block_n=32, num_warps=4, num_stages=2),
    },
    prefill={
        64: PrefillConfig(block_m=128, block_n=64, num_warps=4, num_stages=3),
        128: PrefillConfig(block_m=128, block_n=64, num_warps=8, num_stages=2),
        256: PrefillConfig(block_m=64, block_n=32, num_warps=8, num_stages=2),
    },
    small_batch_linear=(
        LinearRule(SmallBatchLinearConfig(32, 256, num_stages=3), min_elements=_LARGE,
                   more_outputs_than_inputs=True),
        LinearRule(SmallBatchLinearConfig(32, 512, num_stages=3), min_elements=_LARGE),
        LinearRule(SmallBatchLinearConfig(64, 128, num_stages=6), min_n=4096),
        # Few outputs over a long K (Qwen3-30B-A3B's o, 2048 x 4096): one program per 32
        # outputs would leave half the SMs idle; 64-wide tiles split over K in four fill them
        # (7.4 against 10.2 us at batch 1).
        LinearRule(SmallBatchLinearConfig(64, 256, 4), max_n=2048, min_k=4096),
        LinearRule(SmallBatchLinearConfig(32, 256, num_stages=5), min_k=4096),
        LinearRule(SmallBatchLinearConfig(32, 256, 4, l2_prefetch=1024), max_n=1024, min_k=1536),
        LinearRule(SmallBatchLinearConfig(32, 128, l2_prefetch=1024), max_elements=2**20),
        LinearRule(SmallBatchLinearConfig(32, 256, l2_prefetch=1024)),
    ),
    # fp8_gemv at Llama-8B's shapes, 1 and 16 rows (ember.bench.small_batch_linear --fp8): wide
    # weight tiles in 8 warps share each x tile's quantization among more weights; the
    # 28672-output gate_up prefers more, narrower programs (128 x 128: 38.3 us at 1 row, 33.9
    # at 16) and the long-K down longer tiles (256 x 256: 19.6 us, the next 26.3).
    fp8_gemv=(
        LinearRule(Fp8GemvConfig(128, 128, 0, 4, 4), min_n=16384),
        LinearRule(Fp8GemvConfig(256, 256, 0, 8, 3), min_k=8192),
        LinearRule(Fp8GemvConfig(256, 128, 0, 8, 4)),
    ),
    # Given x in fp8 (ember.kernels.rms_norm / silu_and_mul quantize it), 1 row: narrow 64-wide
    # tiles, unsplit or split in two, win at every shape (qkv 8.78 us, o 6.83, gate_up 31.50,
    # down 17.02, against 10.74 / 7.77 / 42.18 / 18.36 with the tiles above).
    fp8_gemv_quantized_x=(
        LinearRule(Fp8GemvConfig(64, 512, 2, 4, 4), min_k=8192),
        LinearRule(Fp8GemvConfig(64, 512, 1, 4, 4), max_n=4096),
        LinearRule(Fp8GemvConfig(64, 256, 1, 4, 4)),
    ),
    # int4_gemv at Llama-8B's shapes, 1 row (ember.bench.quant kernels --sweep, 8- and 16-byte
    # pack loads in one run; raw benchmarks/results/h200-int4-loads-*.json): the wide loads
    # win unsplit at qkv (6.72 against 7.44 us) and o in 8-column tiles (5.78 against 6.55
    # for 16 x 1,024 split in two), and lose at gate_up and wherever K is split (down 18.78
    # against 14.93); the two large ones take 64 x 256 tiles, four programs an SM (gate_up
    # 24.45 against 25.36 us, down 14.34 against 15.12).
    int4_gemv=(
        LinearRule(Int4GemvConfig(64, 256, wide_loads=False, programs_per_sm=4), min_k=8192),
        LinearRule(Int4GemvConfig(64, 256, wide_loads=False, programs_per_sm=4), min_n=16384),
        LinearRule(Int4GemvConfig(8, 1024), max_n=4096),
        LinearRule(Int4GemvConfig(16, 1024)),
    ),
    # 2-4 rows (same sweep, raw h200-int4-rows-sweep.json): 32 x 256 tiles with 8-byte loads
    # at every shape: 83.4 us a layer's four projections at 2 rows, 118.1 at 3, 153.8 at 4
    # (bf16 cuBLAS 117.3-117.7; the weight dequantized and cuBLAS 288-289; the one-row tiles
    # 86.8, 113.6, 191.0).
    int4_gemv_rows=(LinearRule(Int4GemvConfig(32, 256, wide_loads=False)),),
    # w4a8_gemv at Llama-8B's shapes (ember.bench.quant kernels --sweep-w4a8 --rows 1 2 4 on an
    # H100, 2026-12-07, raw benchmarks/results/h100-w4a8-kernels.json), microseconds. One row:
    # 16 x 1,024 with 16-byte loads at qkv (6.29) and gate_up (21.84, 92% of the copy
    # bandwidth), 8 x 1,024 at o (4.57), 32 x 512 split in 3 at down (13.22). Two rows:
    # 64 x 256 with 8-byte loads, 4 a SM (o 6.82, gate_up 27.7, down 15.21), 32 x 512 at qkv
    # (8.07); 16 x 2,048 spills its registers there (184-960).
    w4a8_gemv=(
        LinearRule(Int4GemvConfig(32, 512, programs_per_sm=2), min_k=8192),
        LinearRule(Int4GemvConfig(8, 1024, programs_per_sm=2), max_n=4096),
        LinearRule(Int4GemvConfig(16, 1024, programs_per_sm=2)),
    ),
    w4a8_gemv_rows=(
        LinearRule(Int4GemvConfig(32, 512, wide_loads=False, programs_per_sm=2), min_n=4096,
                   max_n=8192),
        LinearRule(Int4GemvConfig(64, 256, wide_loads=False, programs_per_sm=4)),
    ),
)
