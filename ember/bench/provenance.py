"""Where a benchmark result comes from (the commit it ran at) and where it goes (`report`).

`EMBER_COMMIT` wins over git: a copy of the tree on another machine (the GPU device runs) may
carry a stale git HEAD, so the caller passes the commit it actually sent.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path


def git_commit() -> str:
    given = os.environ.get("EMBER_COMMIT")
    if given:
        return given
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True,
                                       stderr=subprocess.DEVNULL).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def report(result: dict, out: str | None) -> None:
    """Print a benchmark's result as JSON, and write it to ``out`` when given."""
    text = json.dumps(result, indent=1)
    print(text)
    if out:
        Path(out).write_text(text)
