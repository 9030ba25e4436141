"""Building the native CPU kernels: a C source in this package compiled on first use with the
machine's C compiler (``CC``, else ``cc``; -O3 -march=native -fopenmp) into ``EMBER_CACHE_DIR``
(a temporary directory when the cache is off), keyed by the source, the flags and the CPU's
feature flags, so a cache shared between machines never hands one a build for another's CPU.

Every native call goes through ``call``, so that ``capture`` can record a forward's calls (and
refuse a forward that does other work) and a ``NativeGraph`` can replay them: the CPU's decode
graphs, which skip the Python of the layers as CUDA graphs skip the kernel launches."""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from typing import Any, TypeVar

logger = logging.getLogger("ember")

T = TypeVar("T")
FLAGS = ("-O3", "-march=native", "-shared", "-fPIC", "-fopenmp")


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return line
    except OSError:
        pass
    return ""


def build(source_name: str, extra_flags: tuple[str, ...] = ()) -> str:
    """The shared library built from ``source_name`` (a .c file of this package): its path,
    compiled now unless a build with the same key is cached. Raises RuntimeError (with the
    compiler's message) when it cannot be built."""
    from ember import envs

    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        raise RuntimeError("no C compiler found (set CC)")
    source_path = os.path.join(os.path.dirname(__file__), source_name)
    flags = [*FLAGS, *extra_flags]
    with open(source_path, "rb") as f:
        source = f.read()
    key = hashlib.sha256(b"\0".join([source, " ".join([compiler, *flags]).encode(),
                                     _cpu_flags().encode()])).hexdigest()[:16]
    base = envs.cache_dir()
    directory = os.path.join(base, "cpu_kernels") if base else os.path.join(
        tempfile.gettempdir(), f"ember-cpu-kernels-{os.getuid()}")
    stem = os.path.splitext(source_name)[0]
    path = os.path.join(directory, f"{stem}-{key}.so")
    if os.path.exists(path):
        return path
    os.makedirs(directory, exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    start = time.perf_counter()
    # Libraries (-l) go after the source, where the linker still needs their symbols.
    libs = [f for f in flags if f.startswith("-l")]
    options = [f for f in flags if not f.startswith("-l")]
    proc = subprocess.run([compiler, *options, "-o", tmp, source_path, *libs],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{compiler} failed: {proc.stderr.strip()[-2000:]}")
    os.replace(tmp, path)  # atomic: a concurrent build of the same key writes the same file
    logger.info("built the native CPU kernels of %s in %.1f s (%s)", source_name,
                time.perf_counter() - start, path)
    return path


Signatures = dict[str, tuple[Any, list[Any]]]  # function name -> (restype, argtypes)


def open_library(path: str, signatures: Signatures) -> ctypes.CDLL:
    """The built library at ``path`` with each function's ctypes signature set."""
    lib = ctypes.CDLL(path)
    for name, (restype, argtypes) in signatures.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    return lib


def load(source_name: str, signatures: Signatures, extra_flags: tuple[str, ...] = (),
         fallback: str = "") -> ctypes.CDLL | None:
    """``source_name`` built (or taken from the cache) and opened, or None where it cannot be
    (no compiler, a compile error), logged once with what runs instead (``fallback``)."""
    try:
        return open_library(build(source_name, extra_flags), signatures)
    except (RuntimeError, OSError) as exc:
        logger.info("the native CPU kernels of %s are not available (%s): %s", source_name, exc,
                    fallback)
        return None


# ---- replaying a forward's native calls (the CPU's decode graphs) ----------------------------

class CaptureRefused(RuntimeError):
    """A forward under capture did work outside the native calls, which a replay would skip."""


class NativeGraph:
    """The native calls of one captured forward, replayed in order with the same arguments.

    Every tensor whose memory a call reads or writes is kept alive here, so a replay writes
    where the capture did and nowhere else; the caller refills the captured input tensors
    before each replay and reads the captured outputs after it."""

    def __init__(self) -> None:
        self.calls: list[tuple[Callable[..., Any], tuple[Any, ...]]] = []
        self.tensors: list[Any] = []

    def replay(self) -> None:
        for fn, args in self.calls:
            if fn(*args):  # the C functions return nonzero only when out of memory
                raise MemoryError(f"{fn.__name__}: out of memory")


_recording: NativeGraph | None = None


def call(fn: Callable[..., Any], args: tuple[Any, ...], tensors: tuple[Any, ...]) -> Any:
    """``fn(*args)``, also recorded with the ``tensors`` it touches while a capture runs."""
    if _recording is not None:
        _recording.calls.append((fn, args))
        _recording.tensors.extend(tensors)
    return fn(*args)


# What a captured forward may do besides native calls: allocate, take views and read metadata
# (a name missing here only costs the graph: the capture is refused and steps run eagerly).
_ALLOWED = frozenset({
    "empty", "new_empty", "empty_like", "view", "split", "unbind", "select", "narrow",
    "unsqueeze", "squeeze", "transpose", "permute", "t", "as_strided", "expand", "detach",
    "__get__", "dim", "size", "stride", "numel", "data_ptr", "element_size", "is_contiguous",
    "untyped_storage", "storage_offset",
})


def capturing() -> bool:
    """Whether a capture is recording now (on this process's one engine thread)."""
    return _recording is not None


def torch_call(fn: Callable[..., Any], args: tuple[Any, ...], out: Any,
               tensors: tuple[Any, ...]) -> Any:
    """``fn(*args, out=out)``: a torch op that writes a preallocated output, recorded as a call
    of the capture (let through its op check, replayed like a native call). For work with no
    native call that a torch kernel does well, such as a float matmul."""
    global _passthrough
    if _recording is not None:
        _recording.calls.append((_TorchCall(fn, out), args))
        _recording.tensors.extend((*tensors, out))
    _passthrough = True
    try:
        return fn(*args, out=out)
    finally:
        _passthrough = False


class _TorchCall:
    """A recorded torch op: called as the native calls are, returning None (not a status)."""

    def __init__(self, fn: Callable[..., Any], out: Any) -> None:
        self.fn, self.out, self.__name__ = fn, out, getattr(fn, "__name__", "torch op")

    def __call__(self, *args: Any) -> None:
        self.fn(*args, out=self.out)


_passthrough = False


def _refuse_compute_ops():  # type: ignore[no-untyped-def]
    """A torch function mode that lets allocations, views and metadata reads through and
    refuses any other torch call (its work would not be in the replay). A function mode, not
    a dispatch mode: the first dispatch mode of a process costs about a second of imports."""
    import torch
    from torch.overrides import TorchFunctionMode

    class RefuseComputeOps(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            if _passthrough:
                return func(*args, **(kwargs or {}))
            name = getattr(func, "__name__", "")
            basic_index = name == "__getitem__" and not any(
                isinstance(i, torch.Tensor)
                for i in (args[1] if isinstance(args[1], tuple) else (args[1],)))
            if name not in _ALLOWED and not basic_index:
                raise CaptureRefused(f"torch.{name or func} is not a native call")
            return func(*args, **(kwargs or {}))

    return RefuseComputeOps()


def capture(run: Callable[[], T]) -> tuple[NativeGraph, T]:
    """Run ``run()`` once, recording its native calls; raises CaptureRefused when it also ran
    a torch op that does work (the forward must be native calls, allocations and views)."""
    global _recording
    if _recording is not None:
        raise RuntimeError("a native capture is already running")
    graph = NativeGraph()
    _recording = graph
    try:
        with _refuse_compute_ops():
            result = run()
    finally:
        _recording = None
    return graph, result
