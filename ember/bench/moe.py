"""A mixture-of-experts model on a CUDA device, as a fraction of the memory-bandwidth limit.

    python -m ember.bench.moe --model ember/configs/qwen3-30b-a3b --out OUT.json [--kernel]

Runs (dummy bf16 weights) nano-vllm's offline workload (256 prompts, input and output lengths
uniform in [100, 1024]) and batch-1 decode, and counts on the device the experts each MoE
layer call hits (ember.kernels.fused_moe.count_expert_hits). A run's bytes are, per step, the
dense weights (attention, dense MLPs, routers, lm_head) plus every expert hit (distinct experts
per layer) plus the KV cache its decodes read; bytes / time / bandwidth is the fraction
reported. Batch 1 hits exactly top_k experts per layer. ``--kernel`` then times one fused MoE
layer alone (inside a CUDA graph, weights rotated over copies so L2 does not serve them) for a
range of token counts and a few tile configurations, the data for the tuning tables in
ember.kernels.fused_moe and ember.kernels.moe_decode. At decode sizes (up to 64 pairs) it
times both paths side by side, the sorted one and the decode one (routing in its up kernel
or in the route kernel), whichever the dispatch picks: where the decode path should stop.
Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

BANDWIDTH = 4.27e12  # measured device-to-device copy bandwidth of the H200 (bytes/s)


def moe_bytes(cfg: Any, model_cls: type, dtype_bytes: int = 2) -> dict[str, int]:
    """Per-step dense bytes, bytes of one expert, KV bytes per token, and the sparse layers."""
    h, layers, vocab = cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    head = getattr(cfg, "head_dim", None) or h // heads
    num_experts, _, inter, _ = model_cls.moe_shape(cfg)
    sparse = [i for i in range(layers) if model_cls.is_sparse_layer(cfg, i)]
    attn = h * head * (heads + 2 * kv_heads) + heads * head * h
    dense = layers * attn + (layers - len(sparse)) * 3 * h * cfg.intermediate_size
    dense += len(sparse) * num_experts * h + vocab * h  # routers, lm_head
    return {"dense_bytes": dense * dtype_bytes, "expert_bytes": 3 * h * inter * dtype_bytes,
            "kv_bytes_per_token": 2 * layers * kv_heads * head * dtype_bytes,
            "num_sparse_layers": len(sparse)}


def run_workload(llm, ns, shape: dict, device) -> dict:
    from ember import SamplingParams
    from ember.bench.workloads import random_workload
    from ember.kernels import fused_moe

    vocab = llm.llm_engine.model_config.vocab_size
    work = random_workload(ns.num_prompts, tuple(ns.input_len), tuple(ns.output_len), vocab,
                           ns.seed)
    # Warm-up as `ember bench throughput` does: shifted ids (no prefix-cache hit later).
    warm = [{"prompt_token_ids": [(t + 1) % vocab for t in p]} for p in work.prompts[:64]]
    llm.generate(warm, [SamplingParams(max_tokens=16, ignore_eos=True)] * len(warm),
                 use_tqdm=False)
    fused_moe.expert_hit_stats(device, reset=True)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False)
              for n in work.output_lens]
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in work.prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    hits, calls = fused_moe.expert_hit_stats(device, reset=True)
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    steps = calls / shape["num_sparse_layers"]
    # Each decode step of a request reads its context's KV: prompt + tokens so far.
    kv_tokens = sum(len(p) * o + o * (o - 1) // 2 for p, o in zip(work.prompts, work.output_lens))
    total = (steps * shape["dense_bytes"] + hits * shape["expert_bytes"]
             + kv_tokens * shape["kv_bytes_per_token"])
    return {"elapsed_s": elapsed, "output_tok_s": generated / elapsed, "steps": steps,
            "experts_hit_per_layer_step": hits / max(calls, 1), "bytes": total,
            "achieved_tb_s": total / elapsed / 1e12,
            "fraction_of_limit": total / elapsed / ns.bandwidth,
            "num_preemptions": llm.llm_engine.stats()["num_preemptions"]}


def run_batch1(llm, ns, shape: dict, cfg: Any, device) -> dict:
    from ember import SamplingParams
    from ember.kernels import fused_moe

    one = {"prompt_token_ids": [(7 * i) % 10000 for i in range(ns.single_input_len)]}
    llm.generate([one], SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    fused_moe.expert_hit_stats(device, reset=True)
    n = ns.single_output_len
    out = llm.generate([one], SamplingParams(max_tokens=n, ignore_eos=True, detokenize=False),
                       use_tqdm=False)[0]
    hits, calls = fused_moe.expert_hit_stats(device, reset=True)
    m = out.metrics
    per_token = (m.last_token_time - m.first_token_time) / (len(out.outputs[0].token_ids) - 1)
    # One token hits exactly top_k distinct experts in every sparse layer.
    top_k = cfg.num_experts_per_tok
    avg_ctx = ns.single_input_len + n / 2
    step_bytes = (shape["dense_bytes"] + shape["num_sparse_layers"] * top_k * shape["expert_bytes"]
                  + avg_ctx * shape["kv_bytes_per_token"])
    return {"tok_s": 1 / per_token, "ms_per_token": per_token * 1e3, "step_bytes": step_bytes,
            "achieved_tb_s": step_bytes / per_token / 1e12,
            "fraction_of_limit": step_bytes / per_token / ns.bandwidth,
            # Counted on the device over the run (prefill step included): ~top_k when right.
            "experts_hit_per_layer_step": hits / max(calls, 1)}


def kernel_sweep(cfg: Any, model_cls: type, ns) -> list[dict]:
    """One fused MoE layer alone: per-call time in a graph for several token counts and tiles.

    Each row: the dispatched default (``path``: decode or sorted), the fastest candidate, and
    at decode sizes each path's default tiles (``sorted_*``, ``decode_*``, and
    ``decode_route_kernel_*`` with routing in the route kernel instead of the up kernel)."""
    from dataclasses import replace

    import torch

    from ember.bench.timing import graph_time_us
    from ember.kernels import fused_moe as fm
    from ember.kernels import moe_decode as md

    e, k, inter, renorm = model_cls.moe_shape(cfg)
    h = cfg.hidden_size
    copies = 4  # 4 layers' experts (~1.2 GB each at the 30B-A3B shape) > L2
    w13 = [torch.randn(e, 2 * inter, h, device="cuda", dtype=torch.bfloat16) * 0.02
           for _ in range(copies)]
    w2 = [torch.randn(e, h, inter, device="cuda", dtype=torch.bfloat16) * 0.02
          for _ in range(copies)]
    tile = fm.GemmTile
    candidates = {
        "small": [fm.MoeConfig(16, tile(32, 256, 4, 3), tile(64, 128, 4, 3)),
                  fm.MoeConfig(16, tile(64, 128, 4, 4), tile(64, 128, 4, 4)),
                  fm.MoeConfig(16, tile(16, 256, 2, 4), tile(32, 256, 4, 3)),
                  fm.MoeConfig(16, tile(16, 512, 4, 2), tile(16, 256, 2, 3))],
        "large": [fm.MoeConfig(32, tile(64, 128, 4, 3), tile(64, 128, 4, 3)),
                  fm.MoeConfig(64, tile(128, 64, 8, 3), tile(128, 64, 8, 3)),
                  fm.MoeConfig(64, tile(64, 64, 4, 4), tile(128, 64, 4, 4)),
                  fm.MoeConfig(128, tile(128, 64, 8, 3), tile(128, 64, 8, 3))],
    }
    decode = md.decode_config(k, e, torch.bfloat16, True)
    route_kernel = replace(decode, fuse_route=False)
    # Up tiles narrower / wider, shorter steps, 8 warps; down tiles half / twice as tall; each
    # loop with 1-4 steps in flight.
    decode_candidates = [route_kernel, replace(decode, block_n=8), replace(decode, block_n=32),
                         replace(decode, block_k=decode.block_k // 2),
                         replace(decode, block_h=decode.block_h // 2),
                         replace(decode, block_h=decode.block_h * 2,
                                 block_i=decode.block_i // 2),
                         replace(decode, num_warps=8)]
    for up, down in ((1, 1), (2, 2), (3, 3), (1, 3), (3, 1), (4, 4)):
        staged = replace(decode, up_stages=up, down_stages=down)
        decode_candidates += [staged, replace(staged, block_k=decode.block_k // 2),
                              replace(staged, block_n=decode.block_n // 2),
                              replace(staged, block_h=decode.block_h * 2,
                                      block_i=decode.block_i // 2)]
    rows = []
    for tokens in ns.kernel_tokens:
        x = torch.randn(tokens, h, device="cuda", dtype=torch.bfloat16)
        logits = torch.randn(tokens, e, device="cuda", dtype=torch.bfloat16)
        _, ids = torch.softmax(logits.float(), -1).topk(k, -1)
        hit = int(torch.unique(ids).numel())
        nbytes = hit * 3 * h * inter * 2 + tokens * h * 2 * 2
        sorted_default = fm.moe_config(tokens * k, e, torch.bfloat16, True)
        small = tokens * k <= 2 * md.DECODE_MAX_PAIRS
        on_decode = md.takes_decode_path(tokens, k, e)
        default = decode if on_decode else sorted_default
        group = "small" if tokens * k / e <= 4 else "large"
        tried = [default, sorted_default, *candidates[group]]
        if small:
            tried += [decode, *decode_candidates]
        results: dict[str, float] = {}
        for cfg_i in dict.fromkeys(tried):  # each once, in order
            us = graph_time_us(lambda i, c=cfg_i, x=x, lg=logits: fm.fused_moe(
                x, w13[i % copies], w2[i % copies], lg, k, renorm, config=c), calls=16)
            results[str(cfg_i)] = us
        best = min(results, key=results.get)
        fraction = {c: nbytes / (us * 1e-6) / ns.bandwidth for c, us in results.items()}
        row = {"tokens": tokens, "experts_hit": hit, "path": "decode" if on_decode else "sorted",
               "default_us": results[str(default)],
               "default_fraction": fraction[str(default)],
               "best_us": results[best], "best": best, "best_fraction": fraction[best],
               "all_us": results}
        if small:
            for name, c in (("sorted", sorted_default), ("decode", decode),
                            ("decode_route_kernel", route_kernel)):
                row[f"{name}_us"] = results[str(c)]
                row[f"{name}_fraction"] = fraction[str(c)]
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)  # progress; stdout: one line
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="ember/configs/qwen3-30b-a3b")
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--input-len", type=int, nargs=2, default=(100, 1024))
    parser.add_argument("--output-len", type=int, nargs=2, default=(100, 1024))
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--single-input-len", type=int, default=128)
    parser.add_argument("--single-output-len", type=int, default=512)
    parser.add_argument("--bandwidth", type=float, default=BANDWIDTH, help="bytes/s")
    parser.add_argument("--kernel", action="store_true", help="also time one fused MoE layer")
    parser.add_argument("--kernel-tokens", type=int, nargs="+",
                        default=[1, 2, 4, 8, 16, 64, 256, 1024, 4096])
    parser.add_argument("--skip-engine", action="store_true", help="the kernel sweep only")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None)
    ns = parser.parse_args(argv)

    from ember.bench.provenance import git_commit
    from ember.kernels import fused_moe
    from ember.model_resolution import load_hf_config, resolve_model_path
    from ember.registry import ModelRegistry

    cfg = load_hf_config(resolve_model_path(ns.model))[0]
    model_cls, arch = ModelRegistry.resolve_model_cls(cfg.architectures)
    shape = moe_bytes(cfg, model_cls)
    result: dict[str, Any] = {"bench": "moe", "model": ns.model, "arch": arch,
                              "commit": git_commit(), "date": time.strftime("%Y-%m-%d"),
                              "bandwidth_tb_s": ns.bandwidth / 1e12, **shape}
    if not ns.skip_engine:
        import gc

        import torch

        from ember import LLM

        fused_moe.count_expert_hits(True)  # before the engine captures its graphs
        start = time.perf_counter()
        llm = LLM(ns.model, load_format="dummy", dtype="bfloat16",
                  max_model_len=ns.max_model_len, max_num_seqs=ns.max_num_seqs,
                  skip_tokenizer_init=True, gpu_memory_utilization=0.9)
        result["startup_s"] = time.perf_counter() - start
        result["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
        device = llm.llm_engine.executor.runner.device
        result["workload"] = run_workload(llm, ns, shape, device)
        _save(result, ns.out)  # each part as it ends: a time limit keeps what was done
        result["batch1"] = run_batch1(llm, ns, shape, cfg, device)
        result["goals_met"] = {"workload>=0.40": result["workload"]["fraction_of_limit"] >= 0.40,
                               "batch1>=0.50": result["batch1"]["fraction_of_limit"] >= 0.50}
        _save(result, ns.out)
        fused_moe.count_expert_hits(False)
        llm.shutdown()
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    if ns.kernel:
        result["kernel"] = kernel_sweep(cfg, model_cls, ns)
    print(_save(result, ns.out))
    return 0


def _save(result: dict, out: str | None) -> str:
    line = json.dumps(result, default=str)
    if out:
        with open(out, "w") as f:
            f.write(line + "\n")
    return line


if __name__ == "__main__":
    raise SystemExit(main())
