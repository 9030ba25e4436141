"""ShortSwitchInterval: Python's GIL switch interval held short while any of some overlapping
operations is pending (the structured-output manager's bitmask fills on a helper thread), then
put back as it was.

Counted, not toggled: an operation's end may be reported after the next one has begun (a
future's done callback runs on the helper thread), and the interval must stay short until the
last one ends.
"""

from __future__ import annotations

import sys
import threading


class ShortSwitchInterval:
    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._lock = threading.Lock()
        self._pending = 0
        self._saved = sys.getswitchinterval()

    def begin(self) -> None:
        """One operation more: the first shortens the interval (never lengthens it)."""
        with self._lock:
            if self._pending == 0:
                self._saved = sys.getswitchinterval()
                sys.setswitchinterval(min(self._saved, self.interval_s))
            self._pending += 1

    def end(self) -> None:
        """One operation less: the last puts back the interval it found."""
        with self._lock:
            self._pending -= 1
            if self._pending == 0:
                sys.setswitchinterval(self._saved)
