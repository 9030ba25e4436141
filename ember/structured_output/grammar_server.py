"""The grammar process's side (`python -m ember.structured_output.grammar_server FD`, started by
ember.structured_output.grammar_process.GrammarProcess): its setup is the first message on the
pipe; grammar builds run on a thread pool, each step's accepts and fill on the main thread, into
the shared buffers the engine names; it ends on "stop" or when the engine's end of the pipe
closes.
"""

from __future__ import annotations

import logging
import mmap
import os
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ember.gc_heap import freeze_process_heap
from ember.structured_output.config import StructuredOutputsConfig
from ember.structured_output.interface import GrammarSpec

logger = logging.getLogger("ember")


def run_grammar_process(fd: int) -> None:
    """The grammar process's loop: its setup is the first message; builds run on a pool,
    steps on this thread, until "stop" or the engine's end of the pipe closes."""
    import signal
    from multiprocessing.connection import Connection

    # Ctrl-C reaches the whole process group: the engine handles it, and this process ends
    # when the engine's end of the pipe closes.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    conn = Connection(fd)
    try:
        (registry_snapshot, config, load_tokenizer, vocab_size, eos_width, level,
         spin_seconds) = conn.recv()
    except (EOFError, OSError):
        return
    logging.basicConfig(level=level, format="%(levelname)s ember-grammar: %(message)s")
    from ember.registry import restore

    restore(registry_snapshot)
    if spin_seconds > 0:  # the polling main thread hands the GIL to the build pool often
        sys.setswitchinterval(0.0002)
    _GrammarServer(conn, config, load_tokenizer, vocab_size, eos_width, spin_seconds).serve()


class _GrammarServer:
    def __init__(self, conn: Any, config: StructuredOutputsConfig,
                 load_tokenizer: Callable[[], Any], vocab_size: int, eos_width: int,
                 spin_seconds: float = 0.0) -> None:
        from ember.structured_output.compiler import GrammarCompiler

        self.conn = conn
        self.spin_seconds = spin_seconds  # polling before blocking, after each message
        self.compiler = GrammarCompiler(config, load_tokenizer, vocab_size, eos_width)
        self.grammars: dict[int, Any] = {}
        self.building: set[int] = set()
        self.freed_while_building: set[int] = set()
        self.lock = threading.Lock()  # the pipe's sends, and the three collections above
        workers = max(1, min(4, (os.cpu_count() or 2) - 1))
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="ember-grammar")
        self.buffers: dict[int, Any] = {}  # slot -> flat int32 tensor over the shared file
        self.received = 0.0  # perf_counter when the message in hand arrived
        self.heap_frozen = False

    def serve(self) -> None:
        try:
            while True:
                if self.spin_seconds > 0:  # the next step's message comes within a few ms
                    deadline = time.perf_counter() + self.spin_seconds
                    while not self.conn.poll(0) and time.perf_counter() < deadline:
                        pass
                try:
                    message = self.conn.recv()
                except (EOFError, OSError):
                    return  # the engine is gone
                self.received = time.perf_counter()
                kind = message[0]
                if kind == "stop":
                    return
                self._free(message[1])
                if kind == "add":
                    with self.lock:
                        self.building.update(key for key, *_ in message[2])
                    for key, backend, spec, stop_ids in message[2]:
                        self.pool.submit(self._build, key, backend, spec, stop_ids)
                elif kind == "fill":
                    self._fill(*message[2:])
        finally:
            self.pool.shutdown(wait=False, cancel_futures=True)

    def _send(self, message: tuple) -> None:
        with self.lock:
            self.conn.send(message)

    def _free(self, keys: list[int]) -> None:
        if keys:
            with self.lock:
                for key in keys:
                    if self.grammars.pop(key, None) is None and key in self.building:
                        self.freed_while_building.add(key)

    def _build(self, key: int, backend: str, spec: GrammarSpec, stop_ids: list[int]) -> None:
        error = None
        try:
            grammar = self.compiler.build(backend, spec, stop_ids)
        except Exception as exc:  # validated in the front end, so a backend's own failure
            grammar, error = None, f"{type(exc).__name__}: {exc}"
        if not self.heap_frozen:
            # The process's start-up heap (torch, transformers, the tokenizer, the backend's
            # tables) is built with the first grammar: out of the collector's full walks from
            # then on, or a full collection stalls a step's fill (ember.gc_heap).
            self.heap_frozen = True
            freeze_process_heap("grammar process")
        with self.lock:
            self.building.discard(key)
            if key in self.freed_while_building:
                self.freed_while_building.discard(key)
            elif grammar is not None:
                self.grammars[key] = grammar
            self.conn.send(("built", key, error, self.compiler.vocab_size,
                            self.compiler.num_compiled))

    def _fill(self, seq: int, single: dict, replays: list, fills: dict, slot: int,
              path: str | None, numel: int, shape: tuple[int, int]) -> None:
        from ember.structured_output.compiler import (
            Advances,
            advance_grammars,
            fill_grammar_rows,
        )

        try:
            if path is not None:
                self.buffers[slot] = _map_shared(path, numel)
            grammars = self.grammars
            advances = Advances()
            advances.single = {
                name: (rows.tolist(), [grammars[k] for k in keys.tolist()], tokens.tolist())
                for name, (rows, keys, tokens) in single.items()}
            advances.replays = [(row, name, grammars[key], tokens)
                                for row, name, key, tokens in replays]
            outcomes = advance_grammars(self.compiler.backends, advances)
            advanced = time.perf_counter()
            bitmask = self.buffers[slot][:shape[0] * shape[1]].view(shape)
            start = time.perf_counter()
            fill_grammar_rows(self.compiler.backends, {
                name: ([grammars[k] for k in keys.tolist()], rows.tolist())
                for name, (keys, rows) in fills.items()},
                bitmask, {row for row, _ in outcomes})
            end = time.perf_counter()
            with self.lock:
                times = (self.received, advanced, start, end, time.perf_counter())
                self.conn.send(("filled", seq, outcomes, times, len(grammars)))
        except Exception as exc:
            logger.exception("grammar step failed")
            self._send(("failed", seq, f"{type(exc).__name__}: {exc}"))


def _map_shared(path: str, numel: int) -> Any:
    import torch

    with open(path, "r+b") as file:
        region = mmap.mmap(file.fileno(), numel * 4)
    return torch.frombuffer(region, dtype=torch.int32)


if __name__ == "__main__":
    run_grammar_process(int(sys.argv[1]))
