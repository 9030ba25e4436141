"""Writing one entry of ember's disk caches (under EMBER_CACHE_DIR, ember.envs.cache_dir) so that
readers, in any process, see all of it or none of it."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Callable

logger = logging.getLogger("ember")


def write_entry(directory: str, fill: Callable[[str], None], what: str) -> bool:
    """Have ``fill(staging)`` write the entry's files into a fresh directory beside
    ``directory``, then rename it into place, replacing an existing (unusable) entry. Best
    effort: False, logged at debug level, when anything fails (a read-only home, a full disk, a
    concurrent writer that won the rename)."""
    parent = os.path.dirname(directory)
    try:
        os.makedirs(parent, exist_ok=True)
        staging = tempfile.mkdtemp(prefix=".staging-", dir=parent)
        try:
            fill(staging)
            if os.path.isdir(directory):
                shutil.rmtree(directory, ignore_errors=True)
            os.rename(staging, directory)  # atomic: readers see all of it or nothing
        except Exception:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    except Exception as e:
        logger.debug("%s not written to %s (%s)", what, directory, e)
        return False
    return True
