"""Errors the front end raises about the engine core."""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine core crashed, exited or was shut down; no request can be served any more."""
