"""First run against second run in one process, as a new user meets the engine on a fresh machine.

`ember bench throughput` warms up before its clock starts, which hides the one-time costs (kernel
compiles, autotuning, allocator growth) that land in a user's first `generate`. This module times
the engine's start-up, then two `generate` calls of the same shape with no warm-up at all: nano-vllm's
workload (random token ids, input and output lengths uniform in a range, ignore_eos), the second
call on the same lengths with every token id shifted by one so that it gets no prefix-cache hits.
The executor's start-up breakdown (seconds per stage) is kept, and so are the ember log lines
emitted in this process during start-up, with their times (an engine core in a child process logs
to stderr on its own).

    python -m ember.bench.first_run --model ember/configs/qwen3-0.6b --load-format dummy \
        --out first_run.json
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time

from ember.bench.provenance import git_commit


class _TimedLog(logging.Handler):
    """Keeps every record with its time since `start`."""

    def __init__(self, start: float) -> None:
        super().__init__(logging.DEBUG)
        self.start = start
        self.lines: list[tuple[float, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append((round(record.created - self.start, 3), record.getMessage()))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2 GGUF")
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--input-len", type=int, nargs=2, default=[100, 1024], metavar=("LO", "HI"))
    parser.add_argument("--output-len", type=int, nargs=2, default=[100, 1024], metavar=("LO", "HI"))
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep-triton-cache", action="store_true",
                        help="use the machine's Triton cache (default: a new empty one)")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    return parser


def _timed_generate(llm, prompts: list[list[int]], output_lens: list[int]) -> dict:
    from ember import SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False)
              for n in output_lens]
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"elapsed_s": elapsed, "output_tokens": generated, "output_tok_s": generated / elapsed}


def _startup_breakdown(llm) -> dict[str, float] | None:
    """Seconds per start-up stage, from the executor, when the engine core runs in this process
    (in its own process it logs the same breakdown to stderr)."""
    try:
        return dict(llm.llm_engine.executor.startup_breakdown)
    except Exception:  # no in-process executor, or an engine without the profile
        return None


def _compiled_kernels(cache_dir: str | None) -> dict[str, int]:
    """Kernel name -> compiled variants in a Triton cache directory (its metadata JSONs)."""
    import collections
    import glob
    import os

    counts: collections.Counter[str] = collections.Counter()
    if cache_dir and os.path.isdir(cache_dir):
        for path in glob.glob(os.path.join(cache_dir, "*", "*.json")):
            if os.path.basename(path).startswith("__grp__"):
                continue
            try:
                with open(path) as f:
                    name = json.load(f).get("name")
            except (OSError, ValueError):
                continue
            if name:
                counts[name] += 1
    return dict(counts)


def _new_kernels(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: n - before.get(k, 0) for k, n in after.items() if n > before.get(k, 0)}


def main(argv: list[str] | None = None) -> int:
    ns = _parser().parse_args(argv)
    import os
    import tempfile

    # An empty Triton cache of our own: the run meets the engine as a fresh machine does, and
    # what compiles in each phase can be counted.
    cache = None
    if not ns.keep_triton_cache:
        cache = tempfile.mkdtemp(prefix="ember-first-run-triton-")
        os.environ["TRITON_CACHE_DIR"] = cache
    from ember import LLM
    from ember.bench.workloads import random_workload
    from ember.model_resolution import load_hf_config, resolve_model_path

    vocab = load_hf_config(resolve_model_path(ns.model))[0].vocab_size
    workload = random_workload(ns.num_prompts, tuple(ns.input_len), tuple(ns.output_len), vocab,
                               ns.seed)
    from ember import envs

    # As the CLI does, so the engine's INFO lines (its start-up breakdown among them) show.
    logging.basicConfig(level=envs.logging_level(), format="%(levelname)s %(name)s: %(message)s")
    log = _TimedLog(time.time())
    ember_logger = logging.getLogger("ember")
    ember_logger.addHandler(log)
    start = time.perf_counter()
    llm = LLM(ns.model, load_format=ns.load_format, max_model_len=ns.max_model_len,
              skip_tokenizer_init=ns.load_format == "dummy")
    startup = time.perf_counter() - start
    ember_logger.removeHandler(log)
    at_start = _compiled_kernels(cache)
    first = _timed_generate(llm, workload.prompts, workload.output_lens)
    after_first = _compiled_kernels(cache)
    shifted = [[(t + 1) % vocab for t in p] for p in workload.prompts]
    second = _timed_generate(llm, shifted, workload.output_lens)
    first["kernels_compiled"] = _new_kernels(at_start, after_first)
    second["kernels_compiled"] = _new_kernels(after_first, _compiled_kernels(cache))
    result = {
        "date": time.strftime("%Y-%m-%d"), "commit": git_commit(), "args": vars(ns),
        "startup_s": startup, "startup_breakdown": _startup_breakdown(llm),
        "kernels_compiled_at_startup": at_start,
        "startup_log": log.lines, "first": first, "second": second,
        "first_over_second": first["output_tok_s"] / second["output_tok_s"],
    }
    print(json.dumps(result, indent=2))
    if ns.out:
        with open(ns.out, "w") as f:
            json.dump(result, f, indent=2)
    llm.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
