"""The ceilings of a CUDA device (copy bandwidth, bf16 matmul rate) and, for the given models,
the limits they put on the benchmarks (ember.bench.roofline), so results can be quoted as a
fraction of what the device allows.

    python -m ember.bench.ceilings OUT.json [--model ember/configs/qwen3-0.6b ...]

Per model: the batch-1 decode limit of ``ember bench throughput``'s single stream
(--single-input-len/--single-output-len) and the throughput limit of its random workload
(--num-prompts, --input-len, --output-len), with the bench's defaults for the suite's runs.
"""

from __future__ import annotations

import argparse
import json
import types
from pathlib import Path

import torch

from ember.bench.provenance import report
from ember.bench.roofline import ModelShape, decode_latency_limit, throughput_limit
from ember.bench.timing import bench_ms, copy_bandwidth
from ember.bench.workloads import random_workload


def matmul_flops(m: int = 8192) -> float:
    """bf16 FLOP/s of one large square matmul."""
    x = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    y = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    ms = bench_ms(lambda: x @ y, warmup=50, rep=300)
    return 2 * m**3 / (ms * 1e-3)


def model_limits(model_dir: str, bandwidth: float, flops: float, ns: argparse.Namespace) -> dict:
    config = types.SimpleNamespace(**json.loads((Path(model_dir) / "config.json").read_text()))
    shape = ModelShape.from_hf_config(config)
    work = random_workload(ns.num_prompts, tuple(ns.input_len), tuple(ns.output_len),
                           config.vocab_size, 0)
    limit = throughput_limit(shape, [len(p) for p in work.prompts], work.output_lens, bandwidth,
                             flops)
    return {
        "model": model_dir,
        "single_stream_decode_limit_tok_s": decode_latency_limit(
            shape, ns.single_input_len, ns.single_output_len, bandwidth),
        "throughput_limit_output_tok_s": limit["limit_output_tok_s"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="JSON results path")
    parser.add_argument("--model", nargs="*", default=[], help="model directories (config.json)")
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--input-len", type=int, nargs=2, default=(100, 1024))
    parser.add_argument("--output-len", type=int, nargs=2, default=(100, 1024))
    parser.add_argument("--single-input-len", type=int, default=128)
    parser.add_argument("--single-output-len", type=int, default=512)
    ns = parser.parse_args()
    bandwidth = copy_bandwidth(gib=2.0) * 1e12
    flops = matmul_flops()
    result = {"copy_bandwidth_Bps": bandwidth, "bf16_matmul_flops": flops,
              "device": torch.cuda.get_device_name(),
              "models": [model_limits(m, bandwidth, flops, ns) for m in ns.model]}
    report(result, ns.out)


if __name__ == "__main__":
    main()
