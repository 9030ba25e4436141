"""The grammar process's side (`python -m ember.structured_output.grammar_server FD`, started by
ember.structured_output.grammar_process.GrammarProcess): its setup is the first message on the
pipe; grammar builds run on a thread pool, each step's accepts and fill on the main thread, into
the shared buffers the engine names; it ends on "stop" or when the engine's end of the pipe
closes.

The process keeps every grammar's state: the tokens it has taken (each sampled token comes once,
as (key, token) arrays in sampling order), whether it ended (complete, or refusing a token), and
with a reasoning parser where its answer starts (ember.structured_output.reasoning_gate: a
request's first state comes from its prompt, sent with its build). A fill names each bitmask
row's key; rows without a live grammar in its answer allow every token.
"""

from __future__ import annotations

import logging
import mmap
import os
import pickle
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ember.gc_heap import freeze_process_heap
from ember.structured_output.config import StructuredOutputsConfig
from ember.structured_output.interface import GrammarSpec
from ember.structured_output.reasoning_gate import ANSWER, REASONING, UNDECIDED

logger = logging.getLogger("ember")

# A step's fill comes as one little-endian int64 array whose first element is this (its first
# byte is not a pickle's): magic, seq, slot, rows, words, then the counts of the freed keys, the
# accepts and the rows, then the freed keys, the accepts' keys, their tokens and each row's key.
# Anything else on the pipe is pickled (a new buffer's "map" comes before its first fill).
FILL_MAGIC = int.from_bytes(b"EMBFILL\0", "little")


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
        self.backend_of: dict[int, str] = {}
        self.ended: set[int] = set()  # keys whose grammar is complete or refused a token
        # With a reasoning parser (and grammars off while reasoning): the gate, built with the
        # first grammar, and the state of each key not yet in its answer.
        self.gated = bool(config.reasoning_parser) and not config.enable_in_reasoning
        self.gate: Any = None
        self.gate_state: dict[int, str] = {}
        self.building: set[int] = set()
        self.freed_while_building: set[int] = set()
        self.lock = threading.Lock()  # the pipe's sends, and the collections above (builds)
        # Notified as each build ends: a step naming a key still building waits for it (the
        # engine schedules a request at once when its grammar was built before, so its first
        # fill can come before its build is done).
        self.built = threading.Condition(self.lock)
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
                    data = self.conn.recv_bytes()
                except (EOFError, OSError):
                    return  # the engine is gone
                self.received = time.perf_counter()
                if data[:8] == _FILL_MAGIC_BYTES:
                    self._fill_message(data)
                    continue
                message = pickle.loads(data)
                kind = message[0]
                if kind == "stop":
                    return
                self._free(message[1])
                if kind == "add":
                    with self.lock:
                        self.building.update(key for key, *_ in message[2])
                    for key, backend, spec, stop_ids, prompt, quiet in message[2]:
                        self.pool.submit(self._build, key, backend, spec, stop_ids, prompt,
                                         quiet)
                elif kind == "map":
                    _, _, slot, path, numel = message
                    self.buffers[slot] = _map_shared(path, numel)
        finally:
            self.pool.shutdown(wait=False, cancel_futures=True)

    def _fill_message(self, data: bytes) -> None:
        import numpy as np

        words = np.frombuffer(data, "<i8")
        _, seq, slot, rows, width, n_free, n_accepts, n_rows = words[:8].tolist()
        at = 8 + n_free
        self._free(words[8:at].tolist())
        self._fill(seq, words[at:at + n_accepts].tolist(),
                   words[at + n_accepts:at + 2 * n_accepts].tolist(),
                   words[at + 2 * n_accepts:at + 2 * n_accepts + n_rows].tolist(), slot,
                   (rows, width))

    def _send(self, message: tuple) -> None:
        with self.lock:
            self.conn.send(message)

    def _free(self, keys: list[int]) -> None:
        if keys:
            with self.lock:
                for key in keys:
                    self.backend_of.pop(key, None)
                    self.ended.discard(key)
                    self.gate_state.pop(key, None)
                    if self.grammars.pop(key, None) is None and key in self.building:
                        self.freed_while_building.add(key)

    def _build(self, key: int, backend: str, spec: GrammarSpec, stop_ids: list[int],
               prompt: Any, quiet: bool = False) -> None:
        """Build key's grammar and answer (a quiet build: only its failure)."""
        error, state = None, ANSWER
        try:
            grammar = self.compiler.build(backend, spec, stop_ids)
            if self.gated:
                state = self._gate().initial_state(prompt.tolist())
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
                self.backend_of[key] = backend
                if state != ANSWER:
                    self.gate_state[key] = state
            self.built.notify_all()
            if not quiet or error is not None:
                self.conn.send(("built", key, error, self.compiler.vocab_size,
                                self.compiler.num_compiled))

    def _gate(self) -> Any:
        from ember.structured_output.reasoning_gate import ReasoningGate

        with self.lock:
            if self.gate is None:
                self.gate = ReasoningGate(self.compiler.config.reasoning_parser,
                                          self.compiler.tokenizer)
            return self.gate

    def _fill(self, seq: int, accept_keys: list[int], accept_tokens: list[int],
              fill_keys: list[int], slot: int, shape: tuple[int, int]) -> None:
        try:
            if self.building:
                self._await_builds(accept_keys, fill_keys)
            outcomes = self._accept(accept_keys, accept_tokens)
            advanced = time.perf_counter()
            bitmask = self.buffers[slot][:shape[0] * shape[1]].view(shape)
            start = time.perf_counter()
            self._fill_rows(fill_keys, bitmask)
            end = time.perf_counter()
            with self.lock:
                times = (self.received, advanced, start, end, time.perf_counter())
                self.conn.send(("filled", seq, outcomes, times, len(self.grammars)))
        except Exception as exc:
            logger.exception("grammar step failed")
            self._send(("failed", seq, f"{type(exc).__name__}: {exc}"))

    def _await_builds(self, *key_lists: list[int]) -> None:
        """Wait until no key of the lists is still building."""
        with self.built:
            for keys in key_lists:
                while not self.building.isdisjoint(keys):
                    self.built.wait()

    def _plain_rows(self, keys: list[int]) -> tuple[str, list[Any]] | None:
        """The common step, without a per-row loop in Python: every key has a live grammar
        (none freed, ended or reasoning) and one backend holds them all. Then (that backend's
        name, the keys' grammars in order); otherwise None."""
        backends = self.compiler.backends
        if self.gate_state or len(backends) != 1 or not keys:
            return None
        in_order = list(map(self.grammars.get, keys))
        if None in in_order or not self.ended.isdisjoint(keys):
            return None
        return next(iter(backends)), in_order

    def _accept(self, keys: list[int], tokens: list[int]) -> list[tuple[int, bool]]:
        """Each key's grammar takes its token (in order; each backend's in one call where no key
        repeats); returns (key, accepted) of the grammars that ended: accepted False, it
        refused the token; True, it is complete."""
        from ember.structured_output.compiler import Advances, advance_grammars

        grammars, ended, gate_state = self.grammars, self.ended, self.gate_state
        plain = self._plain_rows(keys)
        if plain is not None and len(set(keys)) == len(keys):  # one backend call, no loop
            name, in_order = plain
            outcomes = [(keys[index], ok)
                        for index, ok in self.compiler.backends[name].advance(in_order, tokens)]
            ended.update(key for key, _ in outcomes)
            return outcomes
        outcomes = []
        batch, in_batch = Advances(), set()

        def advance() -> None:
            for index, ok in advance_grammars(self.compiler.backends, batch):
                outcomes.append((keys[index], ok))
                ended.add(keys[index])
            batch.single.clear()
            in_batch.clear()

        for index, (key, token) in enumerate(zip(keys, tokens)):
            grammar = grammars.get(key)
            if grammar is None or key in ended:  # freed, or its request is ending
                continue
            if gate_state:
                state = gate_state.get(key)
                if state is not None:  # reasoning (or its first token): the gate moves on
                    after, takes = self.gate.advance(state, token)
                    if after == ANSWER:
                        del gate_state[key]
                    else:
                        gate_state[key] = after
                    if not takes:
                        continue
            if key in in_batch:  # a second token for one grammar: the first batch goes first
                advance()
            in_batch.add(key)
            batch.add(index, self.backend_of[key], grammar, [token])
        if batch:
            advance()
        return outcomes

    def _fill_rows(self, keys: list[int], bitmask: Any) -> None:
        """Row i of `bitmask` from key i's grammar; rows of keys without one (freed, ended,
        reasoning) allow every token, and an undecided row also the reasoning start tag."""
        from ember.structured_output.compiler import fill_grammar_rows

        grammars, ended, gate_state = self.grammars, self.ended, self.gate_state
        plain = self._plain_rows(keys)
        if plain is not None:  # every row its grammar's, in order
            name, in_order = plain
            fill_grammar_rows(self.compiler.backends, {name: (in_order, list(range(len(keys))))},
                              bitmask)
            return
        by_backend: dict[str, tuple[list, list[int]]] = {}
        undecided = []
        for row, key in enumerate(keys):
            grammar = grammars.get(key)
            if grammar is None or key in ended:
                continue
            if gate_state:
                state = gate_state.get(key)
                if state == REASONING:
                    continue
                if state == UNDECIDED:
                    undecided.append(row)
            entry = by_backend.get(self.backend_of[key])
            if entry is None:
                entry = by_backend[self.backend_of[key]] = ([], [])
            entry[0].append(grammar)
            entry[1].append(row)
        fill_grammar_rows(self.compiler.backends, by_backend, bitmask)
        if undecided:
            self.gate.allow_start(bitmask.numpy(), undecided)


_FILL_MAGIC_BYTES = FILL_MAGIC.to_bytes(8, "little")


def _map_shared(path: str, numel: int) -> Any:
    import torch

    with open(path, "r+b") as file:
        region = mmap.mmap(file.fileno(), numel * 4)
    return torch.frombuffer(region, dtype=torch.int32)


if __name__ == "__main__":
    run_grammar_process(int(sys.argv[1]))
