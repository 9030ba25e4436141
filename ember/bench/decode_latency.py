"""GPU benchmark of paged decode attention at small batch and short context (decode latency).

Batch-1 decode is bound by the sum of ~10 small kernels per layer, and the attention kernel is
one of the larger ones there. This times ``paged_decode_attention`` (and the K/V store it needs)
the way a decode step's CUDA graph runs it: one call per layer, each layer with its own cache so
nothing is served from L2, 32 calls per replayed graph; per call = replay time / 32. It sweeps
the split count and the tile size, with the step's K/V stored by the decode kernel (``new_kv``)
as the triton backend does, for the attention shapes of the shipped models.

    python -m ember.bench.decode_latency --out decode_latency.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from ember.bench.timing import graph_time_us
from ember.kernels.decode_attention import (
    DecodeConfig,
    choose_num_splits,
    decode_workspace_numel,
    default_config,
    paged_decode_attention,
)
from ember.kernels.launch import num_sms
from ember.kernels.tuning import tuning_for

SHAPES = {"llama8b": (32, 8, 128), "qwen3": (16, 8, 128), "smollm2": (9, 3, 64)}
LAYERS = 32
BLOCK_SIZE = 16


def run_case(shape: tuple[int, int, int], batch: int, context: int, splits: int,
             config: DecodeConfig | None) -> float:
    num_heads, num_kv_heads, head_size = shape
    blocks_per_req = -(-context // BLOCK_SIZE)
    num_blocks = batch * blocks_per_req
    caches = [torch.randn(2, num_blocks, BLOCK_SIZE, num_kv_heads, head_size, device="cuda",
                          dtype=torch.bfloat16) for _ in range(LAYERS)]
    block_table = torch.arange(num_blocks, device="cuda", dtype=torch.int32).view(batch, -1)
    seq_lens = torch.full((batch,), context, device="cuda", dtype=torch.int32)
    slots = (block_table[:, (context - 1) // BLOCK_SIZE].long() * BLOCK_SIZE
             + (context - 1) % BLOCK_SIZE)
    q = torch.randn(batch, num_heads, head_size, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(batch, num_kv_heads, head_size, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    out = torch.empty_like(q)
    workspace = torch.empty(decode_workspace_numel(batch, num_heads, head_size, splits),
                            device="cuda")

    def layer(i: int) -> None:
        paged_decode_attention(q, caches[i], seq_lens, block_table, 0.1, out=out,
                               num_splits=splits, workspace=workspace, config=config,
                               new_kv=(k, v, slots))

    return graph_time_us(layer, LAYERS)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--contexts", type=int, nargs="+", default=[128, 384, 640, 1024])
    ns = parser.parse_args()
    device = torch.device("cuda", torch.cuda.current_device())
    sms = num_sms(device)
    results = []
    for name, shape in SHAPES.items():
        for batch in ns.batches:
            policy = default_config(shape[2], tuning=tuning_for(device))
            graph_splits = choose_num_splits(batch, shape[1], None, policy, sms)
            for context in ns.contexts:
                best = None
                for splits in sorted({1, 2, 4, 8, 16, graph_splits}):
                    configs = [None] if splits == 1 else [None, DecodeConfig(block_n=64, num_stages=2),
                                                         DecodeConfig(block_n=32, num_stages=2)]
                    for config in configs:
                        us = run_case(shape, batch, context, splits, config)
                        row = {"shape": name, "batch": batch, "context": context,
                               "splits": splits, "graph_default_splits": graph_splits,
                               "block_n": config.block_n if config else None,
                               "us_per_layer": round(us, 2)}
                        results.append(row)
                        if best is None or us < best["us_per_layer"]:
                            best = row
                default = [r for r in results if r["shape"] == name and r["batch"] == batch
                           and r["context"] == context and r["splits"] == graph_splits
                           and r["block_n"] is None]
                print(f"{name} b{batch} ctx{context}: graph default ({graph_splits} splits) "
                      + " / ".join(f"{r['us_per_layer']} us" for r in default)
                      + f"; best {best['us_per_layer']} us at {best['splits']} splits "
                        f"block_n {best['block_n']}", flush=True)
    if ns.out:
        Path(ns.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
