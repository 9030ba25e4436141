"""Measures the two ceilings of a CUDA device: copy bandwidth (read + write) and bf16 matmul rate."""

import json
import sys

import torch
from triton.testing import do_bench


def main(out: str) -> None:
    n = 1 << 30  # 2 GiB of bf16 per buffer: far beyond L2
    a = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    b = torch.empty_like(a)
    ms = do_bench(lambda: b.copy_(a), warmup=50, rep=300, return_mode="median")
    bandwidth = 2 * a.numel() * a.element_size() / (ms * 1e-3)
    m = 8192
    x = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    y = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    ms = do_bench(lambda: x @ y, warmup=50, rep=300, return_mode="median")
    flops = 2 * m**3 / (ms * 1e-3)
    result = {"copy_bandwidth_Bps": bandwidth, "bf16_matmul_flops": flops,
              "device": torch.cuda.get_device_name()}
    print(json.dumps(result))
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1])
