"""Timing helpers of the GPU kernel benchmarks: median of do_bench, per-call time inside a
replayed CUDA graph, and the device-to-device copy bandwidth that kernels are measured against."""

from __future__ import annotations

from collections.abc import Callable

import torch


def bench_ms(fn: Callable[[], object], warmup: int = 25, rep: int = 100) -> float:
    """Median milliseconds of fn() (triton.testing.do_bench, which flushes L2 between runs)."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def copy_bandwidth(gib: float = 4.0) -> float:
    """Bytes read + written per second by a large device-to-device copy launched as a kernel, in
    TB/s: the practical ceiling of a bandwidth-bound kernel. (The same copy captured in a graph
    runs as a memcpy node, which is slower, so it is timed outside one.)"""
    n = int(gib * 2**30) // 2
    src = torch.randn(n, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))
    return 2 * src.numel() * 2 / (ms * 1e-3) / 1e12


def graph_time_us(fn: Callable[[int], object], calls: int = 20) -> float:
    """fn(i) makes call i; the median per-call time of ``calls`` calls replayed in one CUDA
    graph, as a decode step's graph runs them (launch cost inside the graph counts, host launch
    cost does not)."""
    fn(0)  # compile / warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / calls)
    return sorted(times)[len(times) // 2]
