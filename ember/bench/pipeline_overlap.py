"""Pipeline parallel throughput with several batches in flight vs one (docs/benchmarks.md).

    python -m ember.bench.pipeline_overlap --pp 2 --requests 256 --output-len 32 --repeats 2

Runs the same offline workload on `pipeline_parallel_size` ranks (the `mp` executor, dummy
float32 weights in SmolLM2-135M's layout resized by `--hidden` and `--layers`, with a `--vocab`
small enough that the last stage's LM head does not dominate), alternating
`max_concurrent_batches=1` (a stage waits while the other runs) and the default batch queue (one
batch per stage in flight). Reports generated tokens per second, the most batches the engine
core had in flight, per rank the batches an earlier stage started while the last stage still ran
the one before, and the load average around each run (the machine may be shared). As a control
for the machine it reports how much longer two one-thread matmul processes take at once than
one alone (1.0: a free core for each stage; 2.0: the stages can only take turns). Batches in
flight split the running requests, so the gain needs batches large enough to be compute-bound
(on the CPU, decode at a few requests reads the weights once per batch whatever its size).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path

CONFIG = Path(__file__).resolve().parent.parent / "configs" / "smollm2-135m"


def _matmuls(n: int) -> float:
    import torch

    torch.set_num_threads(1)
    a, w = torch.randn(128, 768), torch.randn(768, 2112)
    start = time.perf_counter()
    for _ in range(n):
        a @ w
    return time.perf_counter() - start


def parallel_capacity(n: int = 1000) -> float:
    """A control for the machine, not for ember: the wall time of two one-thread matmul loops
    run at once over that of one. 1.0: a second core was free for a second stage; 2.0: none
    was (the stages can then only take turns, whatever the engine does)."""
    from multiprocessing import get_context

    with get_context("spawn").Pool(2) as pool:
        pool.map(_matmuls, [10, 10])
        start = time.perf_counter()
        pool.map(_matmuls, [n])
        one = time.perf_counter() - start
        start = time.perf_counter()
        pool.map(_matmuls, [n, n])
        return round((time.perf_counter() - start) / one, 2)


def run(ns: argparse.Namespace, batches: int) -> dict:
    from ember import LLM, SamplingParams, TokensPrompt

    llm = LLM(model=str(CONFIG), load_format="dummy", dtype="float32", skip_tokenizer_init=True,
              hf_overrides={"num_hidden_layers": ns.layers, "vocab_size": ns.vocab,
                            "hidden_size": ns.hidden, "intermediate_size": ns.hidden * 11 // 4,
                            "num_attention_heads": ns.hidden // 64,
                            "num_key_value_heads": max(1, ns.hidden // 256)},
              pipeline_parallel_size=ns.pp, distributed_executor_backend="mp",
              max_concurrent_batches=batches, max_num_seqs=ns.requests, max_model_len=512,
              show_progress=False)
    try:
        rng = random.Random(0)
        prompts = [TokensPrompt(prompt_token_ids=[rng.randrange(3, ns.vocab) for _ in
                                                  range(rng.randint(ns.min_prompt_len, ns.max_prompt_len))])
                   for _ in range(ns.requests)]
        params = SamplingParams(temperature=0.0, max_tokens=ns.output_len, ignore_eos=True)
        llm.generate(prompts[:4], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
        core = llm.llm_engine.engine_core
        core.peak_batches_in_flight = 0
        launch, launches = core.executor.launch, 0

        def counted(plan):
            nonlocal launches
            launches += 1
            return launch(plan)

        core.executor.launch = counted
        before = llm.collective_rpc("overlap_count")
        load_before = os.getloadavg()[0]
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        # Per rank: batches an earlier stage started before the last stage had sampled the one
        # before (0 on the last stage, and with one batch in flight).
        overlaps = [a - b for a, b in zip(llm.collective_rpc("overlap_count"), before)]
        return {"max_concurrent_batches": batches, "seconds": round(seconds, 2),
                "output_tok_s": round(tokens / seconds, 1),
                "peak_batches_in_flight": core.peak_batches_in_flight,
                "stage_overlaps_per_rank": overlaps, "launches": launches,
                "loadavg_1min_before": load_before, "loadavg_1min_after": os.getloadavg()[0]}
    finally:
        llm.shutdown()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=768, help="64 per attention head")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--min-prompt-len", type=int, default=8)
    parser.add_argument("--max-prompt-len", type=int, default=24)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=1,
                        help="alternate the two settings this many times")
    ns = parser.parse_args(argv)
    rows = []
    for _ in range(ns.repeats):
        print(json.dumps({"two_matmul_processes_over_one": parallel_capacity()}), flush=True)
        for batches in (1, ns.pp):
            rows.append(run(ns, batches))
            print(json.dumps(rows[-1]), flush=True)
    print(json.dumps({"two_matmul_processes_over_one": parallel_capacity()}), flush=True)
    base = [r["output_tok_s"] for r in rows if r["max_concurrent_batches"] == 1]
    queue = [r["output_tok_s"] for r in rows if r["max_concurrent_batches"] > 1]
    print(json.dumps({"pp": ns.pp, "speedup": round(sum(queue) / sum(base), 2),
                      "cpu_count": os.cpu_count()}))


if __name__ == "__main__":
    main()
