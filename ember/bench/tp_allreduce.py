"""The all-reduce share of a decode step under tensor parallelism (docs/benchmarks.md).

    python -m ember.bench.tp_allreduce --model ember/configs/smollm2-135m --tp 2 --batch 1 8

Runs an engine with `tensor_parallel_size` ranks (the `mp` executor, dummy weights), installs on
every rank a timer around the communicator's all-reduce and around the model runner's step, runs
decode-only steps, and reports per rank: seconds per decode step, seconds in all-reduce per step
(count and share). On the CPU the collective is gloo's; on CUDA, NCCL's (timed with a device sync
around it, so there the share includes the waits it adds).
"""

from __future__ import annotations

import argparse
import json
import time


def install_timers(runner) -> int:
    """On a worker (collective_rpc): time each all-reduce and each decode-only step."""
    from ember.distributed import parallel_state as ps

    stats = runner.__dict__.setdefault("_bench", {})
    stats.update(all_reduce=0.0, calls=0, step=0.0, steps=0, on=False)
    comm = ps.get_comm()
    platform = runner.platform

    def on_all_reduce(seconds: float) -> None:
        if stats["on"]:
            stats["all_reduce"] += seconds
            stats["calls"] += 1

    comm.on_all_reduce = on_all_reduce
    comm.timer_sync = platform.synchronize
    launch = runner.launch

    def timed_launch(out):
        decode = bool(out.num_scheduled_tokens) and all(
            n == 1 for n in out.num_scheduled_tokens.values())
        stats["on"] = decode
        platform.synchronize()
        start = time.perf_counter()
        step = launch(out)
        step.resolve()
        if decode:
            stats["step"] += time.perf_counter() - start
            stats["steps"] += 1
        stats["on"] = False
        return step

    runner.launch = timed_launch
    return ps.get_rank()


def read_timers(runner, reset: bool = True) -> dict:
    stats = dict(runner._bench)
    if reset:
        runner._bench.update(all_reduce=0.0, calls=0, step=0.0, steps=0)
    return stats


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="ember/configs/smollm2-135m")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--out", default=None)
    ns = parser.parse_args()
    from ember import LLM, SamplingParams, TokensPrompt

    llm = LLM(ns.model, load_format="dummy", skip_tokenizer_init=True, dtype=ns.dtype,
              tensor_parallel_size=ns.tp, distributed_executor_backend="mp", enforce_eager=True,
              max_model_len=ns.prompt_len + ns.output_len + 8, max_num_seqs=max(ns.batch),
              show_progress=False)
    llm.collective_rpc(install_timers)
    results = []
    for batch in ns.batch:
        prompts = [TokensPrompt(prompt_token_ids=[(7 * i + j) % 1000 + 10
                                                  for j in range(ns.prompt_len)])
                   for i in range(batch)]
        params = SamplingParams(max_tokens=ns.output_len, ignore_eos=True, detokenize=False)
        llm.generate(prompts[:1], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
        llm.collective_rpc(read_timers)  # reset after the warm-up
        llm.generate(prompts, params, use_tqdm=False)
        for rank, s in enumerate(llm.collective_rpc(read_timers)):
            row = {"batch": batch, "rank": rank, "decode_steps": s["steps"],
                   "step_ms": 1000 * s["step"] / max(s["steps"], 1),
                   "all_reduce_ms": 1000 * s["all_reduce"] / max(s["steps"], 1),
                   "all_reduce_calls_per_step": s["calls"] / max(s["steps"], 1),
                   "share": s["all_reduce"] / s["step"] if s["step"] else 0.0}
            results.append(row)
            print(f"batch {batch:3d} rank {rank}: {row['step_ms']:.2f} ms/step, all-reduce "
                  f"{row['all_reduce_ms']:.2f} ms ({row['all_reduce_calls_per_step']:.0f} calls) "
                  f"= {100 * row['share']:.1f}% of the step")
    llm.shutdown()
    if ns.out:
        with open(ns.out, "w") as f:
            json.dump({"model": ns.model, "tp": ns.tp, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
