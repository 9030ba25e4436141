"""GPU benchmark of the quantized linear layers and of whole models quantized: bf16 vs fp8 vs AWQ.

    python -m ember.bench.quant kernels --out quant_kernels.json
    python -m ember.bench.quant engine --model ember/configs/llama-3.1-8b \\
        --methods bf16 fp8 fp8-exact-accum fp8-self-quant awq fp8kv fp8-fp8kv --out quant_engine.json

``kernels``: Llama-3.1-8B's projections at 1, 4, 16, 64 and 256 rows: bf16 cuBLAS, the
small-batch bf16 kernel, fp8 (per-token quantization + torch._scaled_mm, and up to 16 rows the
small-batch kernel streaming the fp8 weight) and int4 (int4_gemv up to its 4 rows, with
``--sweep`` a few of its tilings; w4a8_gemv on int8 rows, quantized before and by a kernel of
their own first, ``--sweep-w4a8`` its tilings; int4_mma on the tensor cores up to the layer's
64; at every row count the weight dequantized and cuBLAS, the layer's path above), each timed
inside a CUDA graph over weight copies larger than L2, as bandwidth (weight bytes per second
and the fraction of the copy bandwidth). Every kernel is checked against its dequantized
reference first.

``engine``: one engine per method on dummy weights (AWQ through a temporary config.json carrying
an AWQ quantization_config; fp8 by quantizing the bf16 dummy weights at load; fp8kv = bf16 with
kv_cache_dtype="fp8"; fp8-fp8kv = fp8 weights and the fp8 KV cache), each timed on nano-vllm's
workload (batched throughput) and at batch 1 (single-stream decode) and at a few small batches
(``--small-batches``). Reports tokens/s, the ratio to bf16, the weight bytes one decode step
reads and the fraction of the copy bandwidth that batch-1 decode reaches.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import shutil
import tempfile
import time

import torch
import torch.nn.functional as F

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336)}  # Llama-3.1-8B (out, in)
L2_FLUSH_BYTES = 200 * 2**20
# Engine methods that load the AWQ checkpoint.
AWQ_METHODS = ("awq", "awq-gemv", "awq-bf16x", "awq-prefetch")
DEVICE, DTYPE = "cuda", torch.bfloat16  # a dry run of the code on the CPU sets cpu / float16
# (block_n, block_k, programs per SM, warps, stages) of int4_gemv, timed at one row with 16-
# and with 8-byte pack loads: K splits until the grid holds that many programs per SM.
GEMV_CONFIGS = [(16, 1024, 2, 4, 1), (16, 2048, 2, 4, 1), (16, 512, 2, 4, 1), (8, 1024, 2, 4, 1),
                (16, 1024, 3, 4, 1), (8, 2048, 2, 4, 1), (16, 1024, 4, 4, 1), (64, 256, 4, 4, 1)]
# w4a8_gemv at 1-2 rows (``--sweep-w4a8``), each with 16- and 8-byte pack loads.
W4A8_CONFIGS = [(16, 1024, 2, 4, 1), (8, 1024, 2, 4, 1), (32, 512, 2, 4, 1), (64, 256, 4, 4, 1),
                (16, 2048, 2, 4, 1), (32, 1024, 2, 8, 1), (16, 1024, 4, 4, 1), (64, 512, 2, 8, 1)]
# 2-4 rows: 8-byte loads, and 16 x 1,024 with both.
GEMV_ROWS_CONFIGS = [(16, 1024, 2, 4, 1), (16, 512, 2, 4, 1), (64, 256, 4, 4, 1),
                     (32, 256, 2, 4, 1), (8, 1024, 2, 4, 1), (32, 512, 2, 4, 1)]


def _sweep(rows: int) -> list[tuple[tuple, bool]]:
    """(tiles, 16-byte loads) of int4_gemv to time at ``rows`` rows: one row every tiling with
    both load widths, more rows 8-byte loads and 16 x 1,024 with both."""
    if rows == 1:
        return [(cfg, wide) for cfg in GEMV_CONFIGS for wide in (True, False)]
    return [(GEMV_ROWS_CONFIGS[0], True)] + [(cfg, False) for cfg in GEMV_ROWS_CONFIGS]


def _copies(nbytes: int) -> int:
    return max(2, min(64, -(-L2_FLUSH_BYTES // nbytes)))


def _gemv_config(cfg: tuple, n: int, k: int) -> tuple:
    """A sweep entry with its K splits: until the grid holds the entry's programs per SM, with
    at least two K tiles per split."""
    from ember.kernels.launch import cdiv, num_sms

    block_n, block_k, per_sm = cfg[:3]
    sms = num_sms(torch.device(DEVICE))
    split = max(1, min(cdiv(per_sm * sms, cdiv(n, block_n)), cdiv(k, block_k) // 2 or 1))
    return (block_n, block_k, split, *cfg[3:])


def _timer(row: dict, x: torch.Tensor, copy_bw: float):  # type: ignore[no-untyped-def]
    """timed(key, weight bytes, op, weight copies): op(x, copy) per call inside a CUDA graph,
    cycling over the copies; records microseconds and bandwidth under row[key]."""
    from ember.bench.timing import graph_time_us

    def timed(key: str, nbytes: int, op, copies: list) -> None:  # type: ignore[no-untyped-def]
        us = graph_time_us(lambda i: op(x, copies[i % len(copies)]), max(20, len(copies)))
        rate = nbytes / (us * 1e-6)
        row[key] = {"us": us, "tb_s": rate / 1e12, "fraction_of_copy": rate / copy_bw}

    return timed


def bench_kernels(ns: argparse.Namespace) -> dict:
    from ember.bench.timing import copy_bandwidth
    from ember.kernels.config import kernel_config, use_kernel_config
    from ember.kernels.int4_dequant import int4_dequantize
    from ember.kernels.int4_gemv import MAX_ROWS as GEMV_MAX_ROWS
    from ember.kernels.int4_gemv import int4_gemv
    from ember.kernels.int4_mma import int4_mma
    from ember.kernels.int8_act import quantize_int8
    from ember.kernels.small_batch_linear import small_batch_linear
    from ember.kernels.w4a8_gemv import MAX_ROWS as W4A8_MAX_ROWS
    from ember.kernels.w4a8_gemv import w4a8_gemv
    from ember.quantization.fp8 import fp8_linear, quantize_weight_per_channel
    from ember.quantization.int4_common import awq_to_int4, dequantize_awq
    from ember.quantization.int4_linear import MMA_ROWS
    from ember.testing.quantized_checkpoints import awq_tensors

    copy_bw = copy_bandwidth() * 1e12
    torch.cuda.empty_cache()
    print(f"copy bandwidth {copy_bw / 1e12:.2f} TB/s")
    rows = []
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device=DEVICE) / k**0.5
        tensors, _ = awq_tensors(w.cpu(), 128)
        awq = [tensors[name].to(DEVICE) for name in ("qweight", "qzeros", "scales")]
        awq[2] = awq[2].half()
        deq = dequantize_awq(*awq, 128).t()
        packed = awq_to_int4(*awq, 128)  # ember's in-memory form
        qw, qz, s = packed.qweight, packed.qzeros, packed.scales
        wq8, s8 = quantize_weight_per_channel(w)
        w_bf16 = w.to(DTYPE)
        del w
        int4_bytes = qw.numel() * 4 + qz.numel() * 4 + s.numel() * 2
        # Weight copies that together exceed L2, so every timed call reads HBM.
        sets = {
            "bf16": [w_bf16] + [w_bf16.clone() for _ in range(_copies(n * k * 2) - 1)],
            "fp8": [wq8] + [wq8.clone() for _ in range(_copies(n * k) - 1)],
            "int4": [(qw, qz, s)] + [(qw.clone(), qz.clone(), s.clone())
                                     for _ in range(_copies(int4_bytes) - 1)],
        }
        for m in ns.rows:
            x = torch.randn(m, k, device=DEVICE, dtype=DTYPE)
            ref = x.float() @ deq.float().T
            xq = quantize_int8(x)

            def w4a8(x_, t, config=None, xq=xq):  # x quantized before, as the norms write it
                return w4a8_gemv(*xq, *t, 128, DTYPE, config=config)

            def quant_w4a8(x_, t):  # x quantized by a kernel of its own first
                return w4a8_gemv(*quantize_int8(x_), *t, 128, DTYPE)

            for got in ([int4_gemv(x, qw, qz, s, 128)] if m <= GEMV_MAX_ROWS else []) + (
                    [w4a8(x, (qw, qz, s))] if m <= W4A8_MAX_ROWS else []) + (
                    [int4_mma(x, qw, qz, s, 128)] if m <= MMA_ROWS else []) + [
                    F.linear(x, int4_dequantize(qw, qz, s, 128, x.dtype))]:
                err = ((got.float() - ref).abs().max() / ref.abs().max()).item()
                assert err < 2e-2, f"int4 {name} m={m}: error {err}"
            got8 = fp8_linear(x, wq8, s8, None)
            ref8 = x.float() @ (wq8.float() * s8[:, None]).T
            err8 = ((got8.float() - ref8).abs().max() / ref8.abs().max()).item()
            assert err8 < 0.1, f"fp8 {name} m={m}: error {err8}"
            row = {"shape": name, "n": n, "k": k, "rows": m, "int4_rel_error": err,
                   "fp8_rel_error": err8}

            timed = _timer(row, x, copy_bw)
            timed("bf16_cublas", n * k * 2, F.linear, sets["bf16"])
            if m <= 16:
                timed("bf16_small_batch", n * k * 2, small_batch_linear, sets["bf16"])
            timed("fp8_scaled_mm", n * k + n * 4,
                  lambda x_, wt, s8=s8: fp8_linear(x_, wt, s8, None), sets["fp8"])
            with use_kernel_config(dataclasses.replace(kernel_config(),
                                                       fp8_fast_accumulation=False)):
                timed("fp8_scaled_mm_exact_accum", n * k + n * 4,
                      lambda x_, wt, s8=s8: fp8_linear(x_, wt, s8, None), sets["fp8"])
            if m <= 16:
                timed("fp8_small_batch", n * k + n * 4,
                      lambda x_, wt, s8=s8: fp8_linear(x_, wt, s8, None, 16), sets["fp8"])
            if m <= GEMV_MAX_ROWS:
                timed("int4_gemv", int4_bytes, lambda x_, t: int4_gemv(x_, *t, 128),
                      sets["int4"])
                for cfg, wide in _sweep(m) if ns.sweep else []:
                    c = (*_gemv_config(cfg, n, k), wide)
                    timed(f"int4_gemv_{'x'.join(map(str, c[:5]))}_{'wide' if wide else '8b'}",
                          int4_bytes, lambda x_, t, c=c: int4_gemv(x_, *t, 128, config=c),
                          sets["int4"])
            if m <= W4A8_MAX_ROWS:
                timed("int4_w4a8", int4_bytes, w4a8, sets["int4"])
                timed("int4_w4a8_with_quant", int4_bytes, quant_w4a8, sets["int4"])
                for cfg in W4A8_CONFIGS if ns.sweep_w4a8 and m <= 2 else []:
                    for wide in (True, False):
                        c = (*_gemv_config(cfg, n, k), wide)
                        timed(f"int4_w4a8_{'x'.join(map(str, c[:5]))}_{'wide' if wide else '8b'}",
                              int4_bytes, lambda x_, t, c=c: w4a8(x_, t, c), sets["int4"])
            if m <= MMA_ROWS:
                timed("int4_mma", int4_bytes, lambda x_, t: int4_mma(x_, *t, 128), sets["int4"])
            # The layer's path above int4_mma's rows: the weight dequantized, then cuBLAS.
            timed("int4_dequant_cublas", int4_bytes,
                  lambda x_, t: F.linear(x_, int4_dequantize(*t, 128, x_.dtype)), sets["int4"])
            rows.append(row)
            print(name, m, {key: round(v["us"], 1) for key, v in row.items()
                            if isinstance(v, dict)})
        del sets
        torch.cuda.empty_cache()
    return {"copy_bandwidth_tb_s": copy_bw / 1e12, "rows": rows}


def awq_config_dir(model: str) -> str:
    """A temporary copy of ``model``'s config.json with an AWQ quantization_config."""
    from ember.testing.quantized_checkpoints import quantization_config

    path = tempfile.mkdtemp(prefix="ember-awq-")
    with open(os.path.join(model, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = quantization_config("awq", group_size=128)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return path


def _decode_bytes(model) -> int:
    """Bytes of weights one decode step reads: every parameter and buffer but the embedding
    table (one row of it is read), the logits head included."""
    embed = model.model.embed_tokens.weight
    tied = bool(getattr(model, "tie_word_embeddings", False))
    total = 0
    for t in [*model.parameters(), *model.buffers()]:
        if t is embed and not tied:
            continue
        total += t.numel() * t.element_size()
    return total


def bench_engine(ns: argparse.Namespace) -> dict:
    from ember import LLM, SamplingParams
    from ember.bench.timing import copy_bandwidth
    from ember.bench.workloads import random_workload
    from ember.kernels.config import kernel_config, use_kernel_config

    copy_bw = copy_bandwidth() * 1e12
    torch.cuda.empty_cache()
    results = {"copy_bandwidth_tb_s": copy_bw / 1e12, "methods": {}}
    for method in ns.methods:
        kw = dict(load_format="dummy", dtype="bfloat16", max_model_len=ns.max_model_len,
                  skip_tokenizer_init=True, gpu_memory_utilization=0.9)
        path = ns.model
        if method in AWQ_METHODS:
            path = awq_config_dir(ns.model)
        if method in ("fp8", "fp8-self-quant", "fp8-exact-accum", "fp8-fp8kv", "fp8-prefetch"):
            kw["quantization"] = "fp8"
        if method in ("fp8kv", "fp8-fp8kv"):
            kw["kv_cache_dtype"] = "fp8"
            kw["attention_backend"] = "triton"
        # fp8-self-quant: each fp8 layer quantizes its own input (the norms and SiLU-and-mul
        # write half precision), the path before quantized producers.
        # fp8-exact-accum: cuBLASLt's fp8 GEMMs promote their partial sums to float32 (no fast
        # accumulation). awq-gemv: the 4-bit layers on the CUDA cores (int4_gemv), not the
        # tensor cores. awq-bf16x: the 4-bit layers' inputs stay in half precision at 1-2 rows
        # (int4_gemv), not int8 (w4a8_gemv). awq-prefetch, fp8-prefetch: weights read into L2
        # beside attention (ember.layers.weight_prefetch).
        config = dataclasses.replace(kernel_config(),
                                     quantized_producers=method != "fp8-self-quant",
                                     fp8_fast_accumulation=method != "fp8-exact-accum",
                                     int4_tensor_cores=method != "awq-gemv",
                                     int4_int8_activations=method != "awq-bf16x",
                                     l2_prefetch=method.endswith("-prefetch"))
        start = time.perf_counter()
        with use_kernel_config(config):
            llm = LLM(path, **kw)
        startup = time.perf_counter() - start
        runner = llm.llm_engine.executor.runner
        step_bytes = _decode_bytes(runner.model)
        vocab = llm.llm_engine.model_config.vocab_size
        work = random_workload(ns.num_prompts, tuple(ns.input_len), tuple(ns.output_len), vocab)
        warm = [{"prompt_token_ids": [(t + 1) % vocab for t in p]} for p in work.prompts[:64]]
        llm.generate(warm, SamplingParams(max_tokens=16, ignore_eos=True), use_tqdm=False)
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True,
                                 detokenize=False) for n in work.output_lens]
        t0 = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in work.prompts], params, use_tqdm=False)
        batch_tps = work.num_output_tokens / (time.perf_counter() - t0)
        one = {"prompt_token_ids": work.prompts[0][:128]}
        llm.generate([one], SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
        out = llm.generate([one], SamplingParams(max_tokens=ns.single_output_len,
                                                 ignore_eos=True, detokenize=False),
                           use_tqdm=False)[0]
        m = out.metrics
        single_tps = (len(out.outputs[0].token_ids) - 1) / (m.last_token_time -
                                                            m.first_token_time)
        small = {}
        for size in ns.small_batches:  # decode of a few sequences at once, same prompt length
            reqs = [{"prompt_token_ids": p[:128]} for p in work.prompts[1:size + 1]]
            outs = llm.generate(reqs, SamplingParams(max_tokens=ns.single_output_len,
                                                     ignore_eos=True, detokenize=False),
                                use_tqdm=False)
            first = max(o.metrics.first_token_time for o in outs)
            last = max(o.metrics.last_token_time for o in outs)
            small[size] = sum(len(o.outputs[0].token_ids) - 1 for o in outs) / (last - first)
        results["methods"][method] = {
            "small_batch_tok_s": small,
            "startup_s": startup, "output_tok_s": batch_tps, "single_stream_tok_s": single_tps,
            "decode_weight_gib": step_bytes / 2**30,
            "batch1_fraction_of_copy": step_bytes * single_tps / copy_bw,
            "batch1_limit_tok_s": copy_bw / step_bytes,
        }
        print(method, {k: round(v, 3) for k, v in results["methods"][method].items()
                       if isinstance(v, float)}, "small batches", small)
        llm.shutdown()
        del llm, runner
        gc.collect()
        torch.cuda.empty_cache()
        if method in AWQ_METHODS:
            shutil.rmtree(path, ignore_errors=True)
    base = results["methods"].get("bf16")
    if base:
        for r in results["methods"].values():
            r["batch_vs_bf16"] = r["output_tok_s"] / base["output_tok_s"]
            r["batch1_vs_bf16"] = r["single_stream_tok_s"] / base["single_stream_tok_s"]
            r["small_batch_vs_bf16"] = {b: v / base["small_batch_tok_s"][b]
                                        for b, v in r["small_batch_tok_s"].items()}
    for method, r in results["methods"].items():
        print(f"{method:6s} batch {r['output_tok_s']:8.0f} tok/s ({r.get('batch_vs_bf16', 1):.2f}x)"
              f"  batch-1 {r['single_stream_tok_s']:6.1f} tok/s ({r.get('batch1_vs_bf16', 1):.2f}x,"
              f" {r['batch1_fraction_of_copy']:.0%} of the copy-bandwidth limit "
              f"{r['batch1_limit_tok_s']:.0f})  weights/step {r['decode_weight_gib']:.2f} GiB"
              + "".join(f"  batch-{b} {v:.1f} tok/s ({r.get('small_batch_vs_bf16', {}).get(b, 1):.2f}x)"
                        for b, v in r["small_batch_tok_s"].items()))
    return results


def main() -> None:
    from ember.bench.profile_steps import set_kernel_fields

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="part", required=True)
    k = sub.add_parser("kernels")
    k.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    k.add_argument("--sweep", action="store_true", help="time a few int4_gemv tile configs")
    k.add_argument("--sweep-w4a8", action="store_true",
                   help="time a few w4a8_gemv tile configs at 1-2 rows")
    e = sub.add_parser("engine")
    e.add_argument("--model", default="ember/configs/llama-3.1-8b")
    e.add_argument("--methods", nargs="+", default=["bf16", "fp8", "awq"],
                   choices=["bf16", "fp8", "fp8-exact-accum", "fp8-self-quant", "awq",
                            "awq-gemv", "awq-bf16x", "awq-prefetch", "fp8kv", "fp8-fp8kv",
                            "fp8-prefetch"])
    e.add_argument("--num-prompts", type=int, default=256)
    e.add_argument("--input-len", type=int, nargs=2, default=[100, 1024])
    e.add_argument("--output-len", type=int, nargs=2, default=[100, 1024])
    e.add_argument("--max-model-len", type=int, default=4096)
    e.add_argument("--single-output-len", type=int, default=256)
    e.add_argument("--small-batches", type=int, nargs="*", default=[2, 4],
                   help="also decode this many sequences at once (tok/s against bf16)")
    for p in (k, e):
        p.add_argument("--out", default=None)
        p.add_argument("--kernel-config", nargs="*", default=[], metavar="FIELD=BOOL",
                       help="KernelConfig fields to switch for every method, e.g. "
                            "rotary_in_attention=true")
    ns = parser.parse_args()
    set_kernel_fields(ns.kernel_config)
    result = bench_kernels(ns) if ns.part == "kernels" else bench_engine(ns)
    if ns.out:
        with open(ns.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
