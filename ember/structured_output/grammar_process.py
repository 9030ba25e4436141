"""The grammar process: structured outputs' per-step host work in a process of its own.

Under async scheduling on a GPU a step's masked sampling waits for its bitmask, and the bitmask
needs the step before's tokens accepted by the grammars (ember.core.engine_core). On the engine
thread those accepts, and a fill thread's hand-overs, compete for the interpreter that also
schedules, launches and detokenizes (xgrammar's batched accept holds the GIL). Here the
grammars live in a spawned process, with all their state (ember.structured_output.grammar_server):
a step's message carries the tokens sampled since the last one, as (key, token) arrays, and the
key of each bitmask row; the process accepts them, fills the rows straight into a shared host
buffer (page-locked in the engine's process, so the runner copies it to the device as it is)
and answers with the tokens that ended their grammar. The engine thread does no work per row
beyond gathering keys and tokens; it meanwhile hands its outputs over and schedules the next
step, and reads the answer only when it launches the sampling.

`GrammarProcess` is the engine's side (it starts `python -m
ember.structured_output.grammar_server`, the other side): one pipe, read only by the engine
thread (`pump`, `reply`); grammar builds are answered on the same pipe. A request's grammar
in the engine is a `RemoteGrammar` (a key); the process drops its matcher once the handle is
collected. The bitmask buffers are files under /dev/shm, unlinked
as soon as both processes have mapped them, so nothing outlives the two processes.
"""

from __future__ import annotations

import atexit
import collections
import logging
import mmap
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from ember.structured_output.config import StructuredOutputsConfig
from ember.structured_output.grammar_server import FILL_MAGIC
from ember.structured_output.interface import GrammarSpec

logger = logging.getLogger("ember")

STOP_TIMEOUT_SECONDS = 5.0
# Grammars to build go in messages of this many (or fewer, at the next pump), so the process
# starts building while a large batch is still being added.
ADD_BATCH = 16


class GrammarBuildError(Exception):
    """A grammar the process could not build; the message names the backend's error."""


class RemoteGrammar:
    """A request's grammar in the grammar process (the engine's handle)."""

    __slots__ = ("key", "__weakref__")

    def __init__(self, key: int) -> None:
        self.key = key


class SharedHostBuffer:
    """A flat int32 host buffer in shared memory; `pin` page-locks it in this process (it
    returns the undo, or None where the platform does not)."""

    def __init__(self, numel: int, pin: Callable[[Any], Callable[[], None] | None] | None):
        import torch

        directory = "/dev/shm" if os.path.isdir("/dev/shm") else None
        fd, self.path = tempfile.mkstemp(prefix="ember-grammar-", dir=directory)
        try:
            os.ftruncate(fd, numel * 4)
            region = mmap.mmap(fd, numel * 4)
        finally:
            os.close(fd)
        self.numel = numel
        self.linked = True
        # frombuffer keeps `region` alive as long as the tensor's storage.
        self.tensor = torch.frombuffer(region, dtype=torch.int32)
        self._unpin = pin(self.tensor) if pin is not None else None

    def unlink(self) -> None:
        """Remove the file's name (the mappings stay): once the other process has mapped it."""
        if self.linked:
            self.linked = False
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    def close(self) -> None:
        self.unlink()
        if self._unpin is not None:
            unpin, self._unpin = self._unpin, None
            unpin()


class GrammarProcess:
    """The engine's side of the grammar process (see the module docstring)."""

    def __init__(self, config: StructuredOutputsConfig, load_tokenizer: Callable[[], Any],
                 vocab_size: int, eos_width: int, buffers: int,
                 pin: Callable[[Any], Callable[[], None] | None] | None = None,
                 spin_seconds: float = 0.0) -> None:
        from multiprocessing.connection import Connection

        from ember.registry import snapshot

        # A plain subprocess, not multiprocessing's spawn: spawn runs the user's main script
        # again in the child, which a script without an `if __name__ == "__main__"` guard
        # (LLM.generate at its top level) cannot take.
        ours, theirs = socket.socketpair()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "ember.structured_output.grammar_server",
                 str(theirs.fileno())], pass_fds=(theirs.fileno(),), env=env)
        finally:
            theirs.close()
        self._conn = Connection(ours.detach())
        level = logging.getLevelName(logger.getEffectiveLevel())
        self._conn.send((snapshot(), config, load_tokenizer, vocab_size, eos_width, level,
                         spin_seconds))
        # Waiting for a message, each side polls the pipe for up to this long before it
        # blocks: on a GPU host a thread blocked in read took 0.2-0.8 ms to wake for one.
        self._spin_seconds = spin_seconds
        atexit.register(self.close)
        self._pin = pin
        self._send_lock = threading.Lock()
        self._next_key = 0
        self._builds: dict[int, tuple[Future, RemoteGrammar]] = {}
        # Called on this thread with (key, error) when a quiet build fails (see `add`).
        self.on_quiet_failure: Callable[[int, str], None] = lambda key, error: None
        self._replies: dict[int, tuple] = {}
        self._next_seq = 0
        self._sent_at: dict[int, float] = {}
        self._adds: list[tuple] = []  # grammars to build, not yet sent
        self._received = 0.0  # perf_counter when the last message was read
        # Keys whose handle was collected (appended by finalizers, on any thread).
        self._free: collections.deque[int] = collections.deque()
        self._buffers: list[SharedHostBuffer | None] = [None] * buffers
        self._unlink_after: dict[int, SharedHostBuffer] = {}  # seq -> buffer it maps first
        self.vocab_size = vocab_size  # the process's bitmask width (set with its tokenizer)
        self.num_compiled = 0
        self.live_grammars = 0  # the process's matchers at its last answer (tests, leaks)
        self.closed = False

    # ---- grammars ----------------------------------------------------------------------
    def add(self, backend: str, spec: GrammarSpec, stop_ids: list[int],
            prompt_token_ids: Any = None, quiet: bool = False,
            ) -> tuple[Future | None, RemoteGrammar]:
        """Build a grammar in the process; the future (set by `pump`) gives its RemoteGrammar,
        or raises GrammarBuildError. With a reasoning parser the prompt's ids (an int array)
        give where the answer starts. The handle comes back at once too: a step that names
        its key waits in the process until the build is done. ``quiet`` (a build expected to
        succeed, its grammar built before): no future, and the process answers only a
        failure, passed to `on_quiet_failure(key, error)`."""
        future: Future | None = None
        with self._send_lock:
            key, self._next_key = self._next_key, self._next_key + 1
            handle = RemoteGrammar(key)
            weakref.finalize(handle, self._free.append, key)  # the deque is never replaced
            if not quiet:
                future = Future()
                self._builds[key] = (future, handle)
            # Sent in groups (ADD_BATCH), the rest with the next pump, fill or reply.
            self._adds.append((key, backend, spec, stop_ids, prompt_token_ids, quiet))
        if len(self._adds) >= ADD_BATCH:
            self._flush_adds()
        return future, handle

    def _flush_adds(self) -> None:
        if self._adds:
            with self._send_lock:
                adds, self._adds = self._adds, []
                self._send(("add", self._take_free(), adds))

    def _take_free(self) -> list[int]:
        free = []
        try:
            while True:
                free.append(self._free.popleft())
        except IndexError:
            return free

    def fill(self, accepts: tuple[list[int], list[int]], rows: list[Any], slot: int,
             shape: tuple[int, int]) -> tuple[int, Any]:
        """Ask for a step's grammar work: `accepts` = (keys, tokens), the tokens sampled since
        the last fill, in order, each taken by its key's grammar; then bitmask row i is filled
        from rows[i]'s grammar (requests) into buffer `slot` as an int32 [rows, words] array.
        Returns (the reply's sequence number, the filled view). The message is one int64 array
        sent as it is (pickling its parts cost ~0.04 ms a step, a list of tuples ~0.2)."""
        import numpy as np

        numel = shape[0] * shape[1]
        buffer = self._buffers[slot]
        path = None
        if buffer is None or buffer.numel < numel:
            old = 0 if buffer is None else buffer.numel
            if buffer is not None:
                buffer.close()
            buffer = self._buffers[slot] = SharedHostBuffer(max(numel, 2 * old, 1), self._pin)
            path = buffer.path
        keys, tokens = accepts
        self._flush_adds()
        with self._send_lock:
            seq, self._next_seq = self._next_seq, self._next_seq + 1
            self._sent_at[seq] = time.perf_counter()
            if path is not None:  # a new buffer: the process maps it first
                self._unlink_after[seq] = buffer
                self._send(("map", [], slot, path, buffer.numel))
            # One int64 array sent as it is (grammar_server.FILL_MAGIC).
            free = self._take_free()
            n_free, n_accepts, n_rows = len(free), len(keys), len(rows)
            message = np.empty(8 + n_free + 2 * n_accepts + n_rows, "<i8")
            message[:8] = (FILL_MAGIC, seq, slot, shape[0], shape[1], n_free, n_accepts, n_rows)
            at = 8 + n_free
            message[8:at] = free
            message[at:at + n_accepts] = keys
            message[at + n_accepts:at + 2 * n_accepts] = tokens
            message[at + 2 * n_accepts:] = np.fromiter(
                (r.structured_output.grammar.key for r in rows), np.int64, n_rows)
            try:
                self._conn.send_bytes(message)
            except OSError as exc:
                raise self._exited() from exc
        return seq, buffer.tensor[:numel].view(shape)

    # ---- answers -----------------------------------------------------------------------
    def pump(self, timeout: float = 0.0) -> None:
        """Take what the process has sent (waiting up to `timeout` for the first message)."""
        self._flush_adds()
        conn = self._conn
        while conn.poll(timeout):
            self._dispatch(self._recv())
            timeout = 0.0

    def reply(self, seq: int) -> tuple:
        """The answer to fill `seq`: (the grammars that ended, as (key, accepted); the fill's
        start and end (perf_counter, shared by the two processes); seconds by phase, for step
        timing); waits for it."""
        self._flush_adds()
        self._spin(lambda: seq in self._replies)
        while seq not in self._replies:
            self._dispatch(self._recv())
        return self._replies.pop(seq)

    def _spin(self, done: Callable[[], bool]) -> None:
        """Poll for messages until `done()` or the spin time is over."""
        if self._spin_seconds <= 0:
            return
        conn, deadline = self._conn, time.perf_counter() + self._spin_seconds
        while not done() and time.perf_counter() < deadline:
            if conn.poll(0):
                self._dispatch(self._recv())

    def _send(self, message: tuple) -> None:
        try:
            self._conn.send(message)
        except OSError as exc:
            raise self._exited() from exc

    def _recv(self) -> tuple:
        try:
            message = self._conn.recv()
            self._received = time.perf_counter()
            return message
        except (EOFError, OSError) as exc:
            raise self._exited() from exc

    def _exited(self) -> RuntimeError:
        try:
            code = self.process.wait(1.0)
        except subprocess.TimeoutExpired:
            code = None
        return RuntimeError(f"the grammar process exited (exit code {code}); its log above "
                            "says why")

    def _dispatch(self, message: tuple) -> None:
        kind = message[0]
        if kind == "built":
            _, key, error, self.vocab_size, self.num_compiled = message
            entry = self._builds.pop(key, None)
            if entry is None:  # a quiet build's failure
                self.on_quiet_failure(key, error)
                return
            future, handle = entry
            if error is None:
                future.set_result(handle)
            else:
                future.set_exception(GrammarBuildError(error))
        elif kind == "filled":
            _, seq, outcomes, times, self.live_grammars = message
            received, advanced, start, end, replied = times
            buffer = self._unlink_after.pop(seq, None)
            if buffer is not None:
                buffer.unlink()
            sent = self._sent_at.pop(seq)
            self._replies[seq] = (outcomes, start, end, {
                "process: message in flight": received - sent,
                "process: accepts": advanced - received,
                "process: from accepts to fill": start - advanced,
                "process: reply sent after the fill": replied - end,
                "process: reply in flight": self._received - replied})
        elif kind == "failed":
            raise RuntimeError(f"the grammar process failed a step: {message[2]}")

    def close(self) -> None:
        """Stop the process and release the buffers (idempotent)."""
        if self.closed:
            return
        self.closed = True
        atexit.unregister(self.close)
        try:
            with self._send_lock:
                self._conn.send(("stop",))
        except (OSError, ValueError):
            pass
        try:
            self.process.wait(STOP_TIMEOUT_SECONDS)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._conn.close()
        for buffer in self._buffers:
            if buffer is not None:
                buffer.close()
        self._buffers = [None] * len(self._buffers)
