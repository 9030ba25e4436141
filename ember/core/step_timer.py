"""StepTimer: wall time per engine phase (EMBER_STEP_TIMING=1), to show where a step goes.

Phases: schedule, prepare (host inputs + launch), wait (device work not hidden behind the host:
the one sync per step), update (scheduler bookkeeping), output (the engine core's outputs),
"no launch" (a step with nothing to launch, e.g. every request waiting for its grammar) and
"between steps" (from a step's end to the next one's start: the front end's work, such as
detokenizing, and adding requests).
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
            now = time.perf_counter()
            if self.steps:  # since the last step's last phase: the front end's share
                self.seconds["between steps"] += now - self._last
            self.steps += 1
            self._last = now

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
