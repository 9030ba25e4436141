"""StepTimer: wall time per engine phase (EMBER_STEP_TIMING=1), to show where a step goes.

Phases: schedule, prepare (host inputs + launch), wait (device work not hidden behind the host:
the one sync per step), update (scheduler bookkeeping) and output (detokenize, stop strings).
Work timed on another thread is added under its own name (`add`): it overlaps the phases."""

from __future__ import annotations

import time
from collections import defaultdict


class StepTimer:
    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.seconds: dict[str, float] = defaultdict(float)
        self.steps = 0
        self._last = 0.0

    def start(self) -> None:
        if self.enabled:
            self.steps += 1
            self._last = time.perf_counter()

    def mark(self, phase: str) -> None:
        if self.enabled:
            now = time.perf_counter()
            self.seconds[phase] += now - self._last
            self._last = now

    def add(self, name: str, seconds: float) -> None:
        """Time spent elsewhere (another thread), per step like the phases."""
        if self.enabled:
            self.seconds[name] += seconds

    def summary(self) -> dict[str, float]:
        """Milliseconds per step for each phase."""
        steps = max(self.steps, 1)
        return {phase: 1000 * total / steps for phase, total in self.seconds.items()}
