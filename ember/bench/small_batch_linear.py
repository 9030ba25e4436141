"""GPU benchmark of the linear layers at decode batch sizes: cuBLAS (F.linear) against ember's
small-batch kernel (ember.kernels.small_batch_linear), at the projection shapes of the shipped
models.

Each timing replays a CUDA graph of back-to-back calls, as a decode step's graph does, so launch
cost inside a graph is counted and host launch cost is not; per call = replay time / calls. The
calls cycle over copies of the weight that together exceed L2 (as a step's layers do), so the
weights come from HBM. Bandwidth = weight bytes / time, also as a fraction of the
device-to-device copy bandwidth. Configs are named BLOCK_N x BLOCK_K x SPLIT_K, then lN = N
elements of each W row prefetched into L2 and wAsB = A warps and B pipeline stages (when not 4
and 4). With --pdl 0 1 each is timed with programmatic dependent launch off and on (key suffix
_pdl0 / _pdl1); --norm puts a fused RMSNorm before every call, as in a decoder layer (the norm
is then in every time, cuBLAS's too).
--fp8 times ember.kernels.fp8_gemv instead (float8_e4m3fn weights with per-channel scales, W8A8
on fp8 tensor cores) over its tile configs, against cuBLAS's bf16 call of the same shape and the
fp8 layer's path above 16 rows (per-token quantization + cuBLASLt, ``scaled_mm_us``), and again
with x already quantized per token, as the norms and SiLU-and-mul hand it over (``prequant_*``;
``quant_then_gemv_us``: with the quantization as a kernel of its own); its fractions count one
byte a weight.
The kernel is checked against F.linear first. Sweeps the tiles and prints, per shape, the best
config and whether it beats cuBLAS: the input to the device's rules in ember.kernels.tuning and
to the weight-size limits in ember.layers.linear.

    python -m ember.bench.small_batch_linear --out small_batch_linear.json [--shapes llama8b]
        [--pdl 0 1] [--norm] [--fp8]
"""

from __future__ import annotations

import argparse
import contextlib
import json

import torch
import torch.nn.functional as F
import triton

from ember.bench.timing import copy_bandwidth, graph_time_us
from ember.kernels import KernelConfig, use_kernel_config
from ember.kernels.fp8_gemv import Fp8GemvConfig, fp8_gemv, fp8_gemv_config
from ember.kernels.fp8_quant import per_token_fp8
from ember.kernels.rms_norm import rms_norm
from ember.kernels.small_batch_linear import (
    SmallBatchLinearConfig,
    small_batch_linear,
    small_batch_linear_config,
)

SHAPES = {  # name: (out features N, in features K)
    "smollm2 qkv": (960, 576), "smollm2 o": (576, 576), "smollm2 gate_up": (3072, 576),
    "smollm2 down": (576, 1536), "qwen3 qkv": (4096, 1024), "qwen3 o": (1024, 2048),
    "qwen3 gate_up": (6144, 1024), "qwen3 down": (1024, 3072), "llama8b qkv": (6144, 4096),
    "llama8b o": (4096, 4096), "llama8b gate_up": (28672, 4096), "llama8b down": (4096, 14336),
    "qwen3moe qkv": (5120, 2048), "qwen3moe o": (2048, 4096), "qwen3moe router": (128, 2048),
}
CONFIGS = [SmallBatchLinearConfig(*c) for c in [
    (16, 128), (16, 256), (32, 128), (32, 256), (64, 128), (16, 512),
    (32, 256, 2), (32, 256, 4), (64, 128, 2), (64, 256, 4),
    (32, 128, 1, 1024), (32, 256, 1, 1024), (32, 256, 4, 1024),
    # Deeper pipelines (more W tiles in flight per program) and wider programs.
    *[(32, 256, 1, 0, 4, stages) for stages in (3, 5, 6, 8)],
    (32, 512, 1, 0, 4, 3), (32, 512, 1, 0, 8, 4), (64, 256, 1, 0, 8, 3), (64, 256, 1, 0, 8, 4),
    (16, 256, 1, 0, 4, 6), (16, 256, 1, 0, 4, 8), (16, 512, 1, 0, 4, 6), (64, 128, 1, 0, 4, 6),
    (32, 256, 2, 0, 4, 6), (64, 256, 2, 0, 8, 4), (32, 256, 4, 0, 4, 6),
]]
# fp8_gemv: BLOCK_N x BLOCK_K x SPLIT_K (0: fill the SMs), warps, stages.
FP8_GEMV_CONFIGS = [Fp8GemvConfig(*c) for c in [
    (64, 128), (64, 256), (64, 512), (128, 128), (128, 256), (128, 512),
    (64, 256, 0, 4, 3), (64, 256, 0, 4, 6), (64, 512, 0, 4, 3), (128, 256, 0, 4, 3),
    (128, 256, 0, 4, 6), (128, 128, 0, 4, 8), (64, 128, 0, 4, 8),
    (64, 256, 1), (64, 256, 2), (64, 256, 4), (64, 256, 8), (128, 256, 1), (128, 256, 2),
    (128, 256, 4), (64, 512, 1), (64, 512, 2), (64, 512, 4), (128, 512, 1), (128, 512, 2),
    (128, 256, 0, 8, 4), (128, 512, 0, 8, 3), (256, 256, 0, 8, 3), (256, 128, 0, 8, 4),
]]
MIN_CALLS, MAX_COPIES = 20, 256
L2_FLUSH_BYTES = 200 * 2**20  # several times the H200's L2


def time_calls(op, x: torch.Tensor, weights: list[torch.Tensor], norm: torch.Tensor | None,
               **kwargs) -> float:
    """Per-call time of op(x, w, **kwargs), the calls cycling over the weight copies; with a
    norm weight, op(rms_norm(x), w)."""
    calls = max(MIN_CALLS, len(weights))
    if norm is None:
        return graph_time_us(lambda i: op(x, weights[i % len(weights)], **kwargs), calls)
    return graph_time_us(
        lambda i: op(rms_norm(x, norm, 1e-6), weights[i % len(weights)], **kwargs), calls)


def config_name(cfg: SmallBatchLinearConfig) -> str:
    default = SmallBatchLinearConfig(0, 0)
    return "{}x{}x{}{}{}".format(
        *cfg[:3], f"l{cfg.l2_prefetch}" if cfg.l2_prefetch else "",
        "" if cfg[4:] == default[4:] else f"w{cfg.num_warps}s{cfg.num_stages}")


def fp8_config_name(cfg: Fp8GemvConfig) -> str:
    return "{}x{}x{}w{}s{}".format(*cfg)


def bench_fp8(name: str, n: int, k: int, rows: list[int], norm: torch.Tensor | None,
              copy_bw: float) -> list[dict]:
    """fp8_gemv's configs on one shape (module docstring), checked against its exact reference
    first; configs that do not fit in shared memory are skipped."""
    from ember.quantization.fp8 import (
        fp8_linear,
        fp8_linear_reference,
        quantize_weight_per_channel,
    )

    weight_bytes = n * k
    copies = min(MAX_COPIES, -(-L2_FLUSH_BYTES // weight_bytes))
    bf16_ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
               for _ in range(min(copies, -(-L2_FLUSH_BYTES // (2 * weight_bytes))))]
    fp8_ws, scale = [], None
    for i in range(copies):
        q, scale = quantize_weight_per_channel(bf16_ws[i % len(bf16_ws)])
        fp8_ws.append(q)
    rows_out = []
    for m in rows:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        fitting = []
        for cfg in [None, *FP8_GEMV_CONFIGS]:
            try:
                out = fp8_gemv(x, fp8_ws[-1], scale, config=cfg)
            except triton.runtime.errors.OutOfResources:
                print(f"{name}: {fp8_config_name(cfg)} does not fit (skipped)")
                continue
            block_k = (cfg or fp8_gemv_config(n, k, x.device)).block_k
            want = fp8_linear_reference(x, fp8_ws[-1], scale, block_k)
            torch.testing.assert_close(out.float(), want.float(), rtol=1e-2,
                                       atol=1e-2 * want.abs().max().item())
            fitting.append(cfg)
        row = {"shape": name, "n": n, "k": k, "rows": m, "norm": norm is not None, "fp8": True,
               "default_config": list(fp8_gemv_config(n, k, x.device)),
               "quantized_x_default_config": list(fp8_gemv_config(n, k, x.device, True))}
        row["cublas_bf16_us"] = time_calls(F.linear, x, bf16_ws, norm)
        # The layer's path above its small-batch rows: per-token quantization + cuBLASLt fp8.
        row["scaled_mm_us"] = time_calls(lambda xx, w: fp8_linear(xx, w, scale, None), x,
                                         fp8_ws, norm)
        for cfg in fitting:
            key = f"fp8gemv_{'default' if cfg is None else fp8_config_name(cfg)}_us"
            row[key] = time_calls(lambda xx, w, c=cfg: fp8_gemv(xx, w, scale, config=c), x,
                                  fp8_ws, norm)
        best = min((v, key) for key, v in row.items() if key.startswith("fp8gemv_"))
        row["best"], row["best_us"] = best[1], best[0]
        # x quantized per token by the kernel before (a producer's fused quantization): the
        # GEMV alone, over the same tiles, and with ember.kernels.fp8_quant as its own launch.
        xq, xs = per_token_fp8(x)
        want = (xq.double() @ fp8_ws[-1].double().T) * xs.double() * scale.double()
        for cfg in fitting:
            got = fp8_gemv(xq, fp8_ws[-1], scale, config=cfg, x_scale=xs)
            torch.testing.assert_close(got.double(), want, rtol=1e-2,
                                       atol=1e-2 * want.abs().max().item())
            key = f"prequant_{'default' if cfg is None else fp8_config_name(cfg)}_us"
            row[key] = graph_time_us(
                lambda i, c=cfg, xq=xq, xs=xs: fp8_gemv(xq, fp8_ws[i % len(fp8_ws)], scale,
                                                        config=c, x_scale=xs),
                max(MIN_CALLS, len(fp8_ws)))
        row["prequant_best_us"], row["prequant_best"] = min(
            (v, key) for key, v in row.items() if key.startswith("prequant_"))

        def quant_then_gemv(xx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            q, q_scale = per_token_fp8(xx)
            return fp8_gemv(q, w, scale, x_scale=q_scale)

        row["quant_then_gemv_us"] = time_calls(quant_then_gemv, x, fp8_ws, norm)
        for key in ("cublas_bf16_us", "scaled_mm_us", "fp8gemv_default_us", "best_us",
                    "prequant_default_us", "prequant_best_us"):
            row[key.replace("_us", "_fraction_of_copy")] = (
                (2 if key.startswith("cublas") else 1) * weight_bytes / (row[key] * 1e-6)
                / copy_bw)
        rows_out.append(row)
        print(f"{name:16s} m={m}: cublas bf16 {row['cublas_bf16_us']:7.2f} us, scaled_mm "
              f"{row['scaled_mm_us']:7.2f} us, fp8_gemv "
              f"default {row['fp8gemv_default_us']:7.2f} us "
              f"({row['fp8gemv_default_fraction_of_copy']:.0%}), best {best[0]:7.2f} us "
              f"({row['best_fraction_of_copy']:.0%}) {best[1]}; x quantized before: default "
              f"{row['prequant_default_us']:7.2f} us "
              f"({row['prequant_default_fraction_of_copy']:.0%}), best "
              f"{row['prequant_best_us']:7.2f} us ({row['prequant_best_fraction_of_copy']:.0%}) "
              f"{row['prequant_best']}")
    return rows_out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--shapes", nargs="+", default=None,
                        help="only shapes whose name contains one of these (e.g. llama8b)")
    parser.add_argument("--pdl", nargs="+", default=None, choices=["0", "1"],
                        help="time each config with programmatic dependent launch off (0) / on (1)")
    parser.add_argument("--norm", action="store_true", help="a fused RMSNorm before each call")
    parser.add_argument("--fp8", action="store_true",
                        help="time ember.kernels.fp8_gemv (fp8 weights, W8A8)")
    ns = parser.parse_args()
    pdl_values = ns.pdl or [None]
    copy_bw = copy_bandwidth() * 1e12
    torch.cuda.empty_cache()
    print(f"copy bandwidth {copy_bw / 1e12:.2f} TB/s")
    results = []
    for name, (n, k) in SHAPES.items():
        if ns.shapes and not any(part in name for part in ns.shapes):
            continue
        norm = torch.ones(k, device="cuda", dtype=torch.bfloat16) if ns.norm else None
        if ns.fp8:  # PDL as the process's kernel config sets it
            results.extend(bench_fp8(name, n, k, ns.rows, norm, copy_bw))
            continue
        copies = min(MAX_COPIES, -(-L2_FLUSH_BYTES // (n * k * 2)))
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
              for _ in range(copies)]
        for m in ns.rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            for cfg in [None, *CONFIGS]:
                torch.testing.assert_close(small_batch_linear(x, ws[0], config=cfg).float(),
                                           F.linear(x, ws[0]).float(), atol=0.05, rtol=0.02)
            row = {"shape": name, "n": n, "k": k, "rows": m, "norm": ns.norm,
                   "default_config": list(small_batch_linear_config(n, k, x.device))}
            for pdl in pdl_values:
                suffix = "" if pdl is None else f"_pdl{pdl}"
                # Launch options are fixed as a graph is captured: each timing captures anew.
                with (contextlib.nullcontext() if pdl is None
                      else use_kernel_config(KernelConfig(pdl=pdl == "1"))):
                    row[f"cublas{suffix}_us"] = time_calls(F.linear, x, ws, norm)
                    for cfg in [None, *CONFIGS]:
                        key = f"triton_{'default' if cfg is None else config_name(cfg)}{suffix}_us"
                        row[key] = time_calls(small_batch_linear, x, ws, norm, config=cfg)
            row["cublas_us"] = min(v for key, v in row.items() if key.startswith("cublas"))
            best = min((v, key) for key, v in row.items() if key.startswith("triton_"))
            row["best_triton"] = best[1]
            row["best_triton_us"] = best[0]
            row["cublas_fraction_of_copy"] = n * k * 2 / (row["cublas_us"] * 1e-6) / copy_bw
            row["best_fraction_of_copy"] = n * k * 2 / (best[0] * 1e-6) / copy_bw
            results.append(row)
            print(f"{name:16s} m={m}: cublas {row['cublas_us']:7.2f} us "
                  f"({row['cublas_fraction_of_copy']:.0%}), best triton {best[0]:7.2f} us "
                  f"({row['best_fraction_of_copy']:.0%}) {best[1]}")
    if ns.out:
        with open(ns.out, "w") as f:
            json.dump({"copy_bandwidth_Bps": copy_bw, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
