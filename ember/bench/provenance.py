"""Where a benchmark result comes from: the commit it ran at.

`EMBER_COMMIT` wins over git: a copy of the tree on another machine (the GPU device runs) may
carry a stale git HEAD, so the caller passes the commit it actually sent.
"""

from __future__ import annotations

import os
import subprocess


def git_commit() -> str:
    given = os.environ.get("EMBER_COMMIT")
    if given:
        return given
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True,
                                       stderr=subprocess.DEVNULL).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
