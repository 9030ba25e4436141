"""StartupProfile: where an engine's start-up time went, stage by stage, as seconds by name.

The builder times each stage it runs (imports, plugins, platform, config, weights, memory
profiling, KV cache, graph capture, compile, warm-up); the executor exposes the dict as
``startup_breakdown`` (benchmarks write it into their JSON) and logs ``format_breakdown`` of it
once ready.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator


class StartupProfile:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._start = time.perf_counter()

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        """Time the block under ``name`` (a name timed twice adds up)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def breakdown(self) -> dict[str, float]:
        """Seconds per stage, in the order they ran, plus ``total`` since construction (the
        difference from the stages' sum is untimed glue)."""
        return {**self.seconds, "total": time.perf_counter() - self._start}


def format_breakdown(breakdown: dict[str, float]) -> str:
    """One short line: ``12.3 s (weights 4.10, warmup 2.00, ...)``, stages largest first."""
    stages = sorted(((k, v) for k, v in breakdown.items() if k != "total"), key=lambda kv: -kv[1])
    listed = ", ".join(f"{name} {secs:.2f}" for name, secs in stages)
    total = breakdown.get("total", sum(v for _, v in stages))
    return f"{total:.1f} s ({listed})"
