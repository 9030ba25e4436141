"""Python's cyclic garbage collector kept off what a process builds at start-up.

A process that has imported torch and transformers and built a model holds a few hundred
thousand tracked objects (~200k of them torch's and transformers' own modules). Python's full
(generation 2) collection walks them all: 0.1-0.15 s on the development CPU, and the requests'
outputs kept between batches trigger one every few batches, which then stalls whatever step it
lands in. Objects moved into the collector's permanent generation (`gc.freeze`) are skipped by
every later collection, and never collected: so

- a process ember owns (the engine core's, the grammar process, an `ember serve` HTTP process)
  freezes all it holds once it is ready, as vLLM's engine core does: it never drops an engine;
- the user's process (`LLM`, `AsyncLLM` in their code) freezes once, before its first engine is
  built, what torch's and transformers' imports made, never an engine's own objects: dropping
  an `LLM` must still free its model and KV cache (tests/test_engine_release.py).

EMBER_GC_FREEZE=0 turns both off.
"""

from __future__ import annotations

import gc
import logging
import time

logger = logging.getLogger("ember")

_imports_frozen = False


def freeze_process_heap(what: str) -> None:
    """In a process ember owns, once it is ready (`what` names it, for the debug log): collect,
    then freeze every object alive. Never in the user's process: objects frozen in a reference
    cycle stay for good."""
    from ember import envs

    if envs.gc_freeze():
        _collect_and_freeze(what)


def freeze_imported_heap() -> None:
    """In the user's process, before its first engine is built: torch's and transformers'
    modules (imported here if not yet: the engine imports both) out of the collector's walks.
    Once a process; what the user holds at the time is frozen with them."""
    global _imports_frozen
    from ember import envs

    if _imports_frozen or not envs.gc_freeze():
        return
    _imports_frozen = True
    import torch  # noqa: F401
    import transformers  # noqa: F401

    _collect_and_freeze("imports")


def _collect_and_freeze(what: str) -> None:
    start = time.perf_counter()
    gc.collect()
    gc.freeze()
    logger.debug("%s: %d objects frozen out of the garbage collector's walks in %.0f ms", what,
                 gc.get_freeze_count(), (time.perf_counter() - start) * 1e3)
