"""`ember bench throughput`: offline throughput of ember vs HF transformers on the same weights.

Runs in one process: ember's batched throughput and single-stream decode, then (unless
--no-baseline) HF transformers `generate` on the same weights, batched with left padding, and its
single-stream decode. Prints a table and, with --out, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import platform as host_platform
import time

from ember.bench.provenance import git_commit


def run_ember(ns, workload) -> tuple[dict, object]:
    import os

    from ember import LLM, SamplingParams

    if ns.engine_process:
        os.environ["EMBER_ENGINE_PROCESS"] = "1"
    start = time.perf_counter()
    llm = LLM(
        ns.model, load_format=ns.load_format, dtype=ns.dtype, max_model_len=ns.max_model_len,
        enforce_eager=ns.enforce_eager, attention_backend=ns.attention_backend,
        max_num_seqs=ns.max_num_seqs, max_num_batched_tokens=ns.max_num_batched_tokens,
        skip_tokenizer_init=ns.load_format == "dummy", gpu_memory_utilization=ns.gpu_memory_utilization,
        enable_prefix_caching=not ns.no_prefix_caching,
        async_scheduling=ns.async_scheduling, compile_model=ns.compile_model,
        tensor_parallel_size=ns.tensor_parallel_size,
        pipeline_parallel_size=ns.pipeline_parallel_size,
        distributed_executor_backend=ns.distributed_executor_backend,
    )
    startup = time.perf_counter() - start
    prompts = [{"prompt_token_ids": p} for p in workload.prompts]
    params = [
        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False)
        for n in workload.output_lens
    ]
    # Warm-up on a slice of the workload: 64 prompts of 16 tokens each make chunked prefills
    # mixed with decodes, so the Triton kernels' shape variants are compiled before the clock
    # starts. With an empty Triton cache, a 2-prompt warm-up leaves those compiles inside the
    # timed run (Qwen3 on an H200: 16-17k tok/s instead of 24k).
    # The warm-up prompts are the workload's shifted by one token id, so that none of their
    # blocks is a prefix-cache hit for the timed run.
    vocab = llm.llm_engine.model_config.vocab_size
    warm = [{"prompt_token_ids": [(t + 1) % vocab for t in p]} for p in workload.prompts[:64]]
    llm.generate(warm, [SamplingParams(max_tokens=16, ignore_eos=True)] * len(warm),
                 use_tqdm=False)
    engine = llm.llm_engine
    in_process = not engine.client.multiprocess
    timer = engine.engine_core.timer if in_process else None  # the step timer lives in the core
    if timer is not None:
        timer.seconds.clear()
        timer.steps = 0
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=not ns.no_tqdm)
    elapsed = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    timing = ({"num_steps": timer.steps, **timer.summary()}
              if timer is not None and timer.enabled else None)
    assert generated == workload.num_output_tokens, "ember generated fewer tokens than asked"
    # Single stream: one request, decode only (time per token after the first).
    single = SamplingParams(max_tokens=ns.single_output_len, ignore_eos=True, detokenize=False)
    one = {"prompt_token_ids": workload.prompts[0][: ns.single_input_len]}
    llm.generate([one], SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    out = llm.generate([one], single, use_tqdm=False)[0]
    metrics = out.metrics
    decode_time = metrics.last_token_time - metrics.first_token_time
    single_tps = (len(out.outputs[0].token_ids) - 1) / decode_time
    peak = None
    runner = getattr(engine.executor, "runner", None) if in_process else None  # None: workers
    if runner is not None and str(runner.device).startswith("cuda"):
        import torch

        peak = torch.cuda.max_memory_allocated() / 2**30
    return {
        "engine_core": "in process" if in_process else "own process",
        "executor": engine.engine_core.args.executor_backend() if in_process else None,
        "backend": engine.attention_backend_name,
        "async_scheduling": engine.ready.async_scheduling,
        "cuda_graph_capture_s": (getattr(engine.executor, "graph_capture_seconds", 0.0)
                                 if in_process else None),
        "peak_memory_gib": peak,
        "startup_s": startup,
        "startup_breakdown_s": engine.ready.startup_breakdown,
        "elapsed_s": elapsed,
        "output_tok_s": generated / elapsed,
        "total_tok_s": (generated + workload.num_prompt_tokens) / elapsed,
        "single_stream_decode_tok_s": single_tps,
        "kv_cache_tokens": engine.num_total_blocks() * engine.args.block_size,
        "num_preemptions": engine.stats()["num_preemptions"],
        "step_phase_ms": timing,
    }, llm


def run_hf(ns, workload, cfg, dtype, device, platform) -> dict:
    """HF transformers generate on the same weights (read again from disk; random for dummy)."""
    import torch
    from transformers import AutoModelForCausalLM

    hf_config = cfg.hf_config
    if hasattr(hf_config, "to_transformers"):  # a GGUF file's light config
        hf_config = hf_config.to_transformers()
    hf_config._attn_implementation = "sdpa"
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype).eval()
    if ns.load_format != "dummy":
        from ember.bench.hf_weights import ember_weights_for_hf

        model.load_state_dict(ember_weights_for_hf(cfg), strict=False)
    n = min(ns.hf_num_requests, len(workload.prompts))
    prompts = workload.prompts[:n]
    out_len = min(ns.hf_output_len, min(workload.output_lens[:n]))
    max_len = max(len(p) for p in prompts)
    pad = 0
    ids = torch.tensor([[pad] * (max_len - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (max_len - len(p)) + [1] * len(p) for p in prompts], device=device)
    gen_kwargs = dict(do_sample=False, min_new_tokens=out_len, max_new_tokens=out_len,
                      pad_token_id=pad)
    with torch.inference_mode():
        model.generate(ids[:1, -8:], attention_mask=mask[:1, -8:], max_new_tokens=2,
                       do_sample=False, pad_token_id=pad)  # warm-up
        platform.synchronize()
        start = time.perf_counter()
        model.generate(ids, attention_mask=mask, **gen_kwargs)
        platform.synchronize()
        elapsed = time.perf_counter() - start
        steps = ns.hf_single_output_len or ns.single_output_len  # HF is slow: may be trimmed
        one = torch.tensor([prompts[0][: ns.single_input_len]], device=device)
        t0 = time.perf_counter()
        model.generate(one, max_new_tokens=1, min_new_tokens=1, do_sample=False, pad_token_id=pad)
        platform.synchronize()
        t1 = time.perf_counter()
        model.generate(one, max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                       pad_token_id=pad)
        platform.synchronize()
        t2 = time.perf_counter()
    return {
        "num_requests": n,
        "output_len": out_len,
        "elapsed_s": elapsed,
        "output_tok_s": n * out_len / elapsed,
        "single_stream_decode_tok_s": (steps - 1) / ((t2 - t1) - (t1 - t0)),
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2 GGUF")
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, nargs="+", default=[128],
                        help="one length, or LO HI for uniform lengths")
    parser.add_argument("--output-len", type=int, nargs="+", default=[128])
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--attention-backend", default=None)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                        help="plan the next step while this one runs (default: on for CUDA)")
    parser.add_argument("--compile-model", action="store_true", help="torch.compile the model")
    parser.add_argument("--single-output-len", type=int, default=64)
    parser.add_argument("--single-input-len", type=int, default=128)
    parser.add_argument("--no-baseline", action="store_true", help="skip HF transformers")
    parser.add_argument("--hf-num-requests", type=int, default=64)
    parser.add_argument("--hf-output-len", type=int, default=128)
    parser.add_argument("--hf-single-output-len", type=int, default=None,
                        help="HF's single-stream length (default: --single-output-len)")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--pipeline-parallel-size", type=int, default=1)
    parser.add_argument("--distributed-executor-backend", default=None,
                        help="uni | mp | ray (default: uni for one rank, mp for more)")
    parser.add_argument("--engine-process", action="store_true",
                        help="run the engine core in its own process (EMBER_ENGINE_PROCESS=1)")
    parser.add_argument("--no-tqdm", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="write the results as JSON here")


def _release_memory(device: str) -> None:
    import gc

    gc.collect()
    if device.startswith("cuda"):
        import torch

        torch.cuda.empty_cache()


def _span(values: list[int]) -> tuple[int, int]:
    return (values[0], values[-1]) if len(values) > 1 else (values[0], values[0])


def main(ns: argparse.Namespace) -> int:
    from ember.bench.workloads import random_workload

    result: dict = {"date": time.strftime("%Y-%m-%d"), "commit": git_commit(),
                    "machine": host_platform.processor() or host_platform.machine(),
                    "args": vars(ns).copy()}
    result["args"].pop("func", None)
    from ember.model_resolution import load_hf_config, resolve_model_path

    vocab = load_hf_config(resolve_model_path(ns.model))[0].vocab_size
    workload = random_workload(ns.num_prompts, _span(ns.input_len), _span(ns.output_len), vocab,
                               ns.seed)
    result["ember"], llm = run_ember(ns, workload)
    import torch

    from ember.platforms import resolve_platform

    platform = resolve_platform(None)  # HF runs on ember's device, in ember's dtype
    cfg = llm.llm_engine.model_config
    dtype, device = getattr(torch, cfg.dtype), torch.device(platform.device())
    llm.shutdown()
    del llm  # free ember's KV cache and graphs before HF needs the memory
    _release_memory(str(device))
    if not ns.no_baseline:
        result["hf"] = run_hf(ns, workload, cfg, dtype, device, platform)
        result["ratio_throughput"] = result["ember"]["output_tok_s"] / result["hf"]["output_tok_s"]
        result["ratio_single_stream"] = (
            result["ember"]["single_stream_decode_tok_s"] / result["hf"]["single_stream_decode_tok_s"]
        )
    print(json.dumps(result, indent=2, default=str))
    if ns.out:
        with open(ns.out, "w") as f:
            json.dump(result, f, indent=2, default=str)
    return 0
