"""``python -m ember.bench.gc_pause``: what a full collection of Python's garbage collector
costs once an engine is built, with the start-up heap frozen (ember.gc_heap) and without.

Each variant in a fresh interpreter (freezing is process-wide), alternating, `--runs` of each:
the objects the collector walks and the median milliseconds of `gc.collect()` inside the engine
core's process (`EMBER_ENGINE_PROCESS=1`, asked through `apply_model`; ember freezes it), and
in an application's process after `LLM()` that calls `freeze_process_heap` itself (ember
freezes nothing there). `EMBER_GC_FREEZE=0` for the variant not frozen. Default model unless
`--model`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

from ember.bench.provenance import git_commit, report

_CHILD = """
import json, sys
from ember import LLM


def pause(model=None):  # also sent to the engine core's process (apply_model): imports inside
    import gc, statistics, time
    gc.collect()
    times = []
    for _ in range(7):
        start = time.perf_counter()
        gc.collect()
        times.append(1000 * (time.perf_counter() - start))
    return {"walked": len(gc.get_objects()), "frozen": gc.get_freeze_count(),
            "full_collect_ms": round(statistics.median(times), 2)}


llm = LLM(sys.argv[1] or None, max_model_len=256)
if llm.llm_engine.client.multiprocess:
    where = llm.apply_model(pause)[0]
else:
    from ember.gc_heap import freeze_process_heap
    freeze_process_heap("application")  # what an application that built its engine may do
    where = pause()
print(json.dumps(where))
llm.shutdown()
"""


def _measure(model: str, freeze: bool, engine_process: bool) -> dict:
    env = dict(os.environ, EMBER_GC_FREEZE="1" if freeze else "0",
               EMBER_ENGINE_PROCESS="1" if engine_process else "0")
    out = subprocess.run([sys.executable, "-c", _CHILD, model], env=env, capture_output=True,
                         text=True, timeout=600, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="", help="default: the embedded SmolLM2 GGUF")
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--out", default=None)
    ns = parser.parse_args(argv)
    result: dict = {"commit": git_commit(), "model": ns.model or "SmolLM2-135M-Instruct (default)"}
    for where, engine_process in (("application process", False),
                                  ("engine core process", True)):
        runs: dict[str, list[dict]] = {"frozen": [], "not frozen": []}
        for _ in range(ns.runs):
            for name, freeze in (("frozen", True), ("not frozen", False)):
                runs[name].append(_measure(ns.model, freeze, engine_process))
        result[where] = {name: {"walked": got[0]["walked"], "frozen": got[0]["frozen"],
                                "full_collect_ms": [g["full_collect_ms"] for g in got],
                                "median_ms": statistics.median(g["full_collect_ms"] for g in got)}
                         for name, got in runs.items()}
    report(result, ns.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
