"""GPU benchmark of the kernels that write int8 rows for the 4-bit layers (ember.kernels.int8_act:
RMSNorm with the residual add, SiLU-and-mul), against their half-precision versions, and of a
decoder layer's chain without attention (norm, qkv, o, norm, gate_up, SiLU-and-mul, down) at
Llama-3.1-8B's shapes, each per call inside a replayed CUDA graph (PDL as the engine launches).

    python -m ember.bench.int8_producers [--out F]

Prints one JSON object: microseconds a call, keyed by kernel and rows.
"""

from __future__ import annotations

import argparse
import json

import torch

from ember.bench.timing import graph_time_us

HIDDEN, INTERMEDIATE, QKV = 4096, 14336, 6144  # Llama-3.1-8B


def _weight(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A random 4-bit weight in ember's form (qweight, qzeros, scales), group 128."""
    qweight = torch.randint(-2**31, 2**31 - 1, (n, k // 8), dtype=torch.int32, device="cuda")
    qzeros = torch.randint(-2**31, 2**31 - 1, (k // 128, n // 8), dtype=torch.int32,
                           device="cuda")
    return qweight, qzeros, (torch.rand(k // 128, n, device="cuda") * 0.01).bfloat16()


def bench(rows: int) -> dict[str, float]:
    from ember.kernels.int4_gemv import int4_gemv
    from ember.kernels.rms_norm import fused_add_rms_norm, rms_norm_int8
    from ember.kernels.silu_and_mul import silu_and_mul, silu_and_mul_int8
    from ember.kernels.w4a8_gemv import w4a8_gemv

    x, residual = (torch.randn(rows, HIDDEN, device="cuda").bfloat16() for _ in range(2))
    norm_w = torch.randn(HIDDEN, device="cuda").bfloat16()
    gate_up = torch.randn(rows, 2 * INTERMEDIATE, device="cuda").bfloat16()
    weights = {name: _weight(n, k) for name, (n, k) in
               {"qkv": (QKV, HIDDEN), "o": (HIDDEN, HIDDEN), "gate_up": (2 * INTERMEDIATE, HIDDEN),
                "down": (HIDDEN, INTERMEDIATE)}.items()}

    def layer(_: int) -> torch.Tensor:
        q, scales, sums, h = rms_norm_int8(x, norm_w, 1e-5, residual)
        qkv = w4a8_gemv(q, scales, sums, *weights["qkv"], 128, torch.bfloat16)
        o = int4_gemv(qkv[:, :HIDDEN].contiguous(), *weights["o"], 128)  # attention's stand-in
        q, scales, sums, h = rms_norm_int8(o, norm_w, 1e-5, h)
        up = w4a8_gemv(q, scales, sums, *weights["gate_up"], 128, torch.bfloat16)
        q, scales, sums = silu_and_mul_int8(up)
        return w4a8_gemv(q, scales, sums, *weights["down"], 128, torch.bfloat16)

    return {
        f"rms_norm_int8 {rows}": graph_time_us(lambda _: rms_norm_int8(x, norm_w, 1e-5, residual),
                                               50),
        f"fused_add_rms_norm {rows}": graph_time_us(
            lambda _: fused_add_rms_norm(x, residual, norm_w, 1e-5), 50),
        f"silu_and_mul_int8 {rows}": graph_time_us(lambda _: silu_and_mul_int8(gate_up), 50),
        f"silu_and_mul {rows}": graph_time_us(lambda _: silu_and_mul(gate_up), 50),
        f"layer chain {rows}": graph_time_us(layer, 16),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=None)
    ns = parser.parse_args()
    result = {k: round(v, 3) for rows in (1, 2) for k, v in bench(rows).items()}
    print(json.dumps(result))
    if ns.out:
        with open(ns.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
