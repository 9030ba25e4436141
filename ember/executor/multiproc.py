"""MultiprocExecutor ("mp"): one spawned worker process per rank on this machine.

Each step's SchedulerOutput goes to every rank (one ZeroMQ PUSH socket per rank, the same bytes);
the driver rank (tensor-parallel rank 0 of the last pipeline stage) sends the ModelRunnerOutput
back on a PULL socket. The ranks join torch.distributed through a file in a private directory.
With pipeline parallelism's batch queue (several batches in flight) a rank of an earlier stage
does not wait for a step's tokens before taking the next step (`_serve_batch_queue`).
Registrations and the plugin table reach each process through `ember.registry.snapshot()`.

Faults: the result socket is polled together with every worker's process sentinel, so a worker
that dies (killed, out of memory) is seen at once; the executor then stops the other ranks (a
rank left blocked in a collective would never return) and raises WorkerDiedError, which fails
the step and so every request in flight. Workers ask the kernel to kill them when the process
that started them dies (PR_SET_PDEATHSIG), so none outlives an engine that was killed.
"""

from __future__ import annotations

import atexit
import logging
import os
import pickle
import signal
import tempfile
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import zmq

from ember.config import EngineArgs
from ember.executor.distributed_base import DistributedExecutorBase, WorkerDiedError

if TYPE_CHECKING:
    from ember.core.scheduler_output import SchedulerOutput

logger = logging.getLogger("ember")

STARTUP_TIMEOUT_SECONDS = 1800.0
SHUTDOWN_TIMEOUT_SECONDS = 5.0
PARENT_CHECK_MS = 1000
# Async scheduling: how long a worker waits for step N+1 before resolving step N on its own.
OVERLAP_WAIT_MS = 2


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when its parent ends, however the parent ends."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: the idle loop's parent check below still ends the worker


def run_rank(args: EngineArgs, rank: int, init_method: str, cmd_address: str,
             result_address: str, registry_snapshot: dict, log_level: str | None) -> None:
    """Worker process entry point: build the rank, report, then serve commands until told to
    stop (or until the parent is gone)."""
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    if log_level:
        logging.basicConfig(level=log_level, format=f"%(levelname)s rank{rank}: %(message)s")
    parent = os.getppid()
    ctx = zmq.Context(io_threads=1)
    cmd = ctx.socket(zmq.PULL)
    cmd.connect(cmd_address)
    out = ctx.socket(zmq.PUSH)
    out.setsockopt(zmq.LINGER, 1000)
    out.connect(result_address)
    worker = None
    try:
        from ember.registry import restore
        from ember.worker.rank_worker import RankWorker

        restore(registry_snapshot)
        worker = RankWorker(args, rank, rank, init_method)
        out.send(pickle.dumps(("ready", rank, worker.info)))
        _serve(worker, cmd, out, parent)
    except BaseException as exc:
        import traceback

        out.send(pickle.dumps(("error", rank, f"{type(exc).__name__}: {exc}",
                               traceback.format_exc())))
    finally:
        if worker is not None:
            worker.close()
        cmd.close(linger=0)
        out.close()
        ctx.term()


def _serve(worker, cmd: zmq.Socket, out: zmq.Socket, parent: int) -> None:
    """Run commands in order. Under async scheduling a launched step is resolved only once the
    next step has been launched behind it (or none came within OVERLAP_WAIT_MS), as the engine
    core does in process: the host prepares step N+1 while the device runs step N."""

    overlap_ms = OVERLAP_WAIT_MS if worker.async_scheduling else 0
    pending: tuple[int, Any] | None = None  # (seq, launched step) not yet resolved

    def finish() -> None:
        nonlocal pending
        seq, step = pending  # type: ignore[misc]
        pending = None
        result = worker.finish(step)
        if result is not None:
            out.send(b"S" + pickle.dumps((seq, result), protocol=pickle.HIGHEST_PROTOCOL))

    if worker.max_concurrent_batches > 1:
        return _serve_batch_queue(worker, cmd, out, parent)
    while True:
        if pending is not None and not cmd.poll(overlap_ms):
            finish()
            continue
        if pending is None and not cmd.poll(PARENT_CHECK_MS):
            if os.getppid() != parent:
                return
            continue
        message = cmd.recv()
        kind = message[:1]
        if kind == b"S":  # step: b"S" + pickled (seq, plan); hot path, no extra framing
            seq, plan = pickle.loads(message[1:])
            step = worker.launch(plan)
            if pending is not None:
                finish()
            pending = (seq, step)
            continue
        if pending is not None:
            finish()
        if kind == b"R":
            _answer_rpc(worker, message, out)
        elif kind == b"Q":
            return


def _serve_batch_queue(worker, cmd: zmq.Socket, out: zmq.Socket, parent: int) -> None:
    """Pipeline parallel with several batches in flight: a rank of an earlier stage launches
    each step and goes on to the next (RankWorker.launch_queued keeps it); the last stage runs
    each step to the end, and the driver sends its result back, so results come in order."""

    while True:
        if not cmd.poll(PARENT_CHECK_MS):
            if os.getppid() != parent:
                return
            continue
        message = cmd.recv()
        kind = message[:1]
        if kind == b"S":
            seq, plan = pickle.loads(message[1:])
            step = worker.launch_queued(plan)
            result = None if step is None else worker.finish(step)
            if result is not None:
                out.send(b"S" + pickle.dumps((seq, result), protocol=pickle.HIGHEST_PROTOCOL))
            continue
        if kind == b"R":
            worker.drain()
            _answer_rpc(worker, message, out)
        elif kind == b"Q":
            return


def _answer_rpc(worker, message: bytes, out: zmq.Socket) -> None:
    """Run a collective_rpc message ("R" + pickled call) on this rank and send its reply (or
    the exception it raised) back to the driver."""
    from ember.pickling import dumps, loads

    call_id, method, args, kwargs = loads(message[1:])
    try:
        reply = ("ok", worker.rpc(method, args, kwargs))
        payload = dumps(("rpc", call_id, worker.rank, reply), "the collective_rpc result")
    except Exception as exc:
        payload = dumps(("rpc", call_id, worker.rank, ("error", exc)), "an rpc error")
    out.send(b"R" + payload)


class MultiprocExecutor(DistributedExecutorBase):
    def _start_workers(self, args: EngineArgs, world_size: int) -> None:
        import multiprocessing

        from ember.pickling import portable_args
        from ember.registry import snapshot

        args = portable_args(args)
        self._dir = tempfile.TemporaryDirectory(prefix="ember-mp-")
        name = uuid.uuid4().hex[:8]
        self._ctx = zmq.Context(io_threads=1)
        self._cmd = []
        for rank in range(world_size):
            sock = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.bind(f"ipc://{self._dir.name}/{name}-cmd{rank}")
            self._cmd.append(sock)
        self._results = self._ctx.socket(zmq.PULL)
        self._results.setsockopt(zmq.LINGER, 0)
        result_address = f"ipc://{self._dir.name}/{name}-out"
        self._results.bind(result_address)
        init_method = f"file://{self._dir.name}/{name}-dist"
        spawn = multiprocessing.get_context("spawn")
        level = logging.getLevelName(logger.getEffectiveLevel())
        snap = snapshot()
        self.procs = [
            spawn.Process(target=run_rank, name=f"ember-rank{rank}",
                          args=(args, rank, init_method, f"ipc://{self._dir.name}/{name}-cmd{rank}",
                                result_address, snap, level))
            for rank in range(world_size)
        ]
        for proc in self.procs:
            proc.start()
        atexit.register(self.shutdown)
        self._poller = zmq.Poller()
        self._poller.register(self._results, zmq.POLLIN)
        for proc in self.procs:
            self._poller.register(proc.sentinel, zmq.POLLIN)
        infos: dict[int, Any] = {}
        while len(infos) < world_size:
            message = self._receive(STARTUP_TIMEOUT_SECONDS)
            infos[message[1]] = message[2]
        self._set_infos([infos[r] for r in range(world_size)])

    # ---- transport -------------------------------------------------------------------------
    def _send_step(self, seq: int, plan: SchedulerOutput) -> None:
        payload = b"S" + pickle.dumps((seq, plan), protocol=pickle.HIGHEST_PROTOCOL)
        for sock in self._cmd:
            sock.send(payload, copy=False)

    def _wait_step(self, seq: int) -> Any:
        while seq not in self._step_results:
            self._receive(None)
        return self._step_results.pop(seq)

    def _run_rpc(self, method: str | Callable[..., Any], args: tuple,
                 kwargs: dict[str, Any] | None) -> list[Any]:
        from ember.pickling import dumps

        call_id = next(self._call_ids)
        payload = b"R" + dumps((call_id, method, args, kwargs or {}), "the collective_rpc call")
        for sock in self._cmd:
            sock.send(payload)
        replies: dict[int, Any] = {}
        while len(replies) < self.world_size:
            while call_id in self._rpc_results and self._rpc_results[call_id]:
                rank, reply = self._rpc_results[call_id].pop()
                replies[rank] = reply
            if len(replies) < self.world_size:
                self._receive(None)
        self._rpc_results.pop(call_id, None)
        return self._unpack_rpc([replies[r] for r in range(self.world_size)])

    def _receive(self, timeout_s: float | None) -> tuple:
        """The next message from a worker, filing step and rpc results; raises when a worker
        died or reported an error."""
        from ember.pickling import loads

        if self._dead is not None:
            raise WorkerDiedError(self._dead)
        events = dict(self._poller.poll(None if timeout_s is None else int(timeout_s * 1000)))
        if self._results in events:
            message = self._results.recv()
            kind = message[:1]
            if kind == b"S":
                seq, result = pickle.loads(message[1:])
                self._step_results[seq] = result
                return ("step", seq)
            if kind == b"R":
                _, call_id, rank, reply = loads(message[1:])
                self._rpc_results.setdefault(call_id, []).append((rank, reply))
                return ("rpc", call_id)
            decoded = pickle.loads(message)
            if decoded[0] == "error":
                _, rank, text, trace = decoded
                logger.debug("rank %d failed:\n%s", rank, trace)
                # A rank whose peer was killed fails in its collective: name the killed one.
                for other, proc in enumerate(self.procs):
                    proc.join(0.2 if other != rank else 0)
                    if proc.exitcode is not None and proc.exitcode < 0:
                        self._fail(f"worker rank {other} (pid {proc.pid}) died "
                                   f"({_describe_exit(proc.exitcode)})")
                self._fail(f"rank {rank} failed: {text}", value_error=text.startswith("ValueError"))
            return decoded
        for rank, proc in enumerate(self.procs):
            if proc.sentinel in events or (not events and proc.exitcode is not None):
                proc.join(1.0)
                self._fail(f"worker rank {rank} (pid {proc.pid}) died "
                           f"({_describe_exit(proc.exitcode)})")
        if not events:
            self._fail(f"the workers did not answer within {timeout_s:.0f} s")
        return ()

    def _stop_workers(self) -> None:
        for sock in getattr(self, "_cmd", []):
            try:
                sock.send(b"Q", zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        for proc in getattr(self, "procs", []):
            proc.join(SHUTDOWN_TIMEOUT_SECONDS if self._dead is None else 0.1)
        for proc in getattr(self, "procs", []):
            if proc.is_alive():
                proc.terminate()
                proc.join(SHUTDOWN_TIMEOUT_SECONDS)
            if proc.is_alive():
                proc.kill()
                proc.join(SHUTDOWN_TIMEOUT_SECONDS)
        for sock in [*getattr(self, "_cmd", []), getattr(self, "_results", None)]:
            if sock is not None:
                sock.close(linger=0)
        if getattr(self, "_ctx", None) is not None:
            self._ctx.term()
            self._ctx = None
        if getattr(self, "_dir", None) is not None:
            self._dir.cleanup()
            self._dir = None
        atexit.unregister(self.shutdown)


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


__all__ = ["MultiprocExecutor", "WorkerDiedError"]
