"""Profile a window of engine steps on the GPU: device time per kernel and host time per step.

Runs the nano-vllm workload (dummy weights) through LLMEngine.step(), skips the prefill-heavy
start, then records `--steps` decode steps with torch.profiler and prints the kernels by device
time, the device busy time per step and the wall time per step, so one sees whether a step is
bound by the host (wall >> device) or by the device.

Usage: python -m ember.bench.profile_steps --model ember/configs/qwen3-0.6b [--steps 20] [--out F]
Batch 1 (the single-stream case): add --num-requests 1 --input-len 128 128 --output-len 600 600
--no-pdl: each kernel's device time without the wait that PDL folds into it.
--quantization fp8 (or another method): the model quantized as LLM(quantization=...) would.
--kernel-config FIELD=BOOL ...: KernelConfig switches (e.g. int4_int8_activations=true).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from ember import LLMEngine, SamplingParams
from ember.bench.workloads import random_workload
from ember.config import EngineArgs
from ember.sampling_params import RequestOutputKind


def _engine_core(engine: LLMEngine):
    """The part that holds the scheduler and the executor: the in-process engine core behind
    the front end where there is one, else the engine itself."""
    return getattr(getattr(engine, "client", None), "core", engine)


def _time_calls(obj, names: list[str], totals: dict[str, float]) -> None:
    """Wrap obj.<name> for each name so its wall time adds up in totals[name]."""
    for name in names:
        fn = getattr(obj, name)

        def timed(*args, _fn=fn, _name=name, **kwargs):
            start = time.perf_counter()
            try:
                return _fn(*args, **kwargs)
            finally:
                totals[_name] += time.perf_counter() - start

        setattr(obj, name, timed)


def host_breakdown(engine: LLMEngine, steps: int) -> dict[str, float]:
    """Milliseconds per step spent in the main host-side pieces of a step (no profiler)."""
    from collections import defaultdict

    import ember.worker.model_runner as model_runner_module

    totals: dict[str, float] = defaultdict(float)
    core = _engine_core(engine)
    runner = core.executor.runner
    _time_calls(runner, ["_update_states", "_fill_placeholders", "_sample", "launch"], totals)
    _time_calls(runner.stager, ["begin", "end"], totals)
    if runner.graph_runner is not None:
        _time_calls(runner.graph_runner, ["run"], totals)
    _time_calls(core.scheduler, ["schedule", "update_from_output"], totals)
    _time_calls(engine.output_processor, ["process"], totals)
    _time_calls(model_runner_module, ["build_flat_batch"], totals)
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    totals["step (wall)"] = time.perf_counter() - start
    return {k: round(1000 * v / steps, 3) for k, v in totals.items()}


def set_kernel_fields(assignments: list[str]) -> None:
    """Switch the named KernelConfig fields ("field=true" / "field=false") for this process."""
    import dataclasses

    from ember.kernels import KernelConfig, kernel_config, set_kernel_config

    fields = {f.name for f in dataclasses.fields(KernelConfig)}
    changes = {}
    for item in assignments:
        name, _, value = item.partition("=")
        if name not in fields or value.lower() not in ("true", "false"):
            raise SystemExit(f"--kernel-config {item!r}: expected FIELD=true|false, FIELD one "
                             f"of {', '.join(sorted(fields))}")
        changes[name] = value.lower() == "true"
    set_kernel_config(dataclasses.replace(kernel_config(), **changes))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--skip", type=int, default=60, help="steps to run before recording")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--input-len", type=int, nargs=2, default=(100, 1024))
    parser.add_argument("--output-len", type=int, nargs=2, default=(100, 1024))
    parser.add_argument("--no-pdl", action="store_true",
                        help="launch without programmatic dependent launch, so each kernel's "
                             "profiled time is its own (with PDL it includes its wait)")
    parser.add_argument("--quantization", default=None,
                        help="quantize the dummy model at load (e.g. fp8)")
    parser.add_argument("--kernel-config", nargs="*", default=[], metavar="FIELD=BOOL",
                        help="KernelConfig fields to switch, e.g. int4_int8_activations=true")
    parser.add_argument("--out", default=None)
    ns = parser.parse_args()
    set_kernel_fields(["pdl=false"] * ns.no_pdl + ns.kernel_config)

    engine = LLMEngine(EngineArgs(model=ns.model, load_format="dummy", skip_tokenizer_init=True,
                                  max_model_len=4096, show_progress=False,
                                  quantization=ns.quantization))
    vocab = engine.model_config.vocab_size
    work = random_workload(ns.num_requests, tuple(ns.input_len), tuple(ns.output_len), vocab, 0)
    for i, (prompt, n) in enumerate(zip(work.prompts, work.output_lens)):
        engine.add_request(str(i), {"prompt_token_ids": prompt},
                           SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True,
                                          detokenize=False,  # as LLM.generate / the bench
                                          output_kind=RequestOutputKind.FINAL_ONLY))
    for _ in range(ns.skip):
        engine.step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(ns.steps):  # no wrappers, no profiler: the step time a user sees
        engine.step()
    torch.cuda.synchronize()
    plain_ms = 1000 * (time.perf_counter() - start) / ns.steps
    breakdown = host_breakdown(engine, ns.steps)
    print("host ms per step:", json.dumps(breakdown, indent=1))
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(ns.steps):
            engine.step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    events = prof.key_averages()
    device_us = sum(e.self_device_time_total for e in events)
    # Kernels (and memcpys) show device time but no host time of their own.
    kernels = sum(e.count for e in events
                  if e.self_device_time_total > 0 and e.self_cpu_time_total == 0)
    table = events.table(sort_by="self_device_time_total", row_limit=25)
    host = events.table(sort_by="self_cpu_time_total", row_limit=25)
    summary = {
        "model": ns.model, "quantization": ns.quantization, "steps": ns.steps,
        "running": len(_engine_core(engine).scheduler.running),
        "plain_wall_ms_per_step": plain_ms,
        "profiled_wall_ms_per_step": 1000 * wall / ns.steps,
        "device_busy_ms_per_step": device_us / 1000 / ns.steps,
        "device_kernels_per_step": kernels / ns.steps,
        "host_ms_per_step": breakdown,
    }
    print(json.dumps(summary, indent=1))
    print(table)
    print(host)
    if ns.out:
        with open(ns.out, "w") as f:
            json.dump(summary, f, indent=1)
            f.write("\n" + table + "\n" + host)


if __name__ == "__main__":
    main()
