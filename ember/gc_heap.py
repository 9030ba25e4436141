"""Python's cyclic garbage collector kept off what a process ember owns builds at start-up.

A process that has imported torch and transformers and built a model holds a few hundred
thousand tracked objects. Python's full (generation 2) collection walks them all: 0.05-0.3 s
(the development CPU, an H200 host), and the requests' outputs kept between batches trigger
one every few batches, which then stalls whatever step it lands in. Objects moved into the
collector's permanent generation (`gc.freeze`) are skipped by every later collection, and
never collected. So a process ember owns (the engine core's, the grammar process, an `ember
serve` HTTP process) freezes all it holds once it is ready, as vLLM's engine core does: it
lives as long as its engine.

The user's process (`LLM`, `AsyncLLM` in their code) is left alone: what is frozen there
includes the user's own objects, and one of them in a reference cycle that holds an `LLM` (an
object keeping a bound method of itself) would then keep the model and its KV cache for good
(tests/test_engine_release.py). An application that builds its engines once may call
`freeze_process_heap` itself after that, as ember's benchmarks do. EMBER_GC_FREEZE=0 turns it
off everywhere.
"""

from __future__ import annotations

import gc
import logging
import time

logger = logging.getLogger("ember")


def freeze_process_heap(what: str) -> None:
    """Collect, then freeze every object alive now (`what` names the process, for the debug
    log): once the process is ready, in a process that never drops what it has built."""
    from ember import envs

    if not envs.gc_freeze():
        return
    start = time.perf_counter()
    gc.collect()
    gc.freeze()
    logger.debug("%s: %d objects frozen out of the garbage collector's walks in %.0f ms", what,
                 gc.get_freeze_count(), (time.perf_counter() - start) * 1e3)
