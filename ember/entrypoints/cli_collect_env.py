"""`ember collect-env`: the facts a bug report needs, as vLLM's `collect_env` gives them.

Sections: ember, Python and OS, CPU (model, cores, the SIMD flags the CPU kernels care about),
PyTorch (version, CUDA/HIP build) and GPUs (names, memory, driver), the versions of the packages
ember leans on, the platform ember would choose, the registered plugins and registries (the same
listing as `ember plugins`), and the relevant environment variables (secrets masked).

Each fact is read independently and a failure prints as that fact's value: a report is most
needed on a broken machine. Package versions come from installed metadata (no import); GPUs from
nvidia-smi / rocm-smi when present, else from torch, which is never asked to initialise a device
it does not have.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from typing import Any

PACKAGES = ("torch", "triton", "flashinfer-python", "transformers", "tokenizers", "safetensors",
            "gguf", "numpy", "pydantic", "fastapi", "uvicorn", "pyzmq", "msgspec", "pluggy",
            "openai")
# The CPU flags that decide which CPU kernels (and torch's own) are fast.
CPU_FLAGS = ("avx", "avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
             "avx512_bf16", "amx_bf16", "amx_tile", "neon", "asimd", "sve")
# Variables outside EMBER_* that change what ember or its libraries do.
OTHER_ENV = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES",
             "CUDA_HOME", "TORCH_CUDA_ARCH_LIST", "TRITON_INTERPRET", "TRITON_CACHE_DIR",
             "OMP_NUM_THREADS", "MKL_NUM_THREADS", "HF_HOME", "HF_HUB_OFFLINE",
             "TRANSFORMERS_OFFLINE", "NCCL_DEBUG", "PYTORCH_CUDA_ALLOC_CONF")
_SECRET = re.compile(r"KEY|TOKEN|SECRET|PASSWORD", re.IGNORECASE)


def _safe(fact: Callable[[], Any]) -> Any:
    try:
        return fact()
    except Exception as exc:  # the report goes on; this fact says why it is missing
        return f"could not read ({type(exc).__name__}: {exc})"


def _run(cmd: list[str]) -> str | None:
    if shutil.which(cmd[0]) is None:
        return None
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _version(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return "not installed"


def _cpuinfo() -> dict[str, str]:
    """The first processor's fields in /proc/cpuinfo (Linux); empty elsewhere."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if not line.strip():
                    if fields:
                        break
                    continue
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields


def cpu_section() -> list[tuple[str, Any]]:
    info = _cpuinfo()
    model = info.get("model name") or _run(["sysctl", "-n", "machdep.cpu.brand_string"]) \
        or platform.processor() or "unknown"
    flags = set((info.get("flags") or info.get("Features") or "").split())
    if not flags and sys.platform == "darwin":
        flags = set((_run(["sysctl", "-n", "machdep.cpu.features",
                           "machdep.cpu.leaf7_features"]) or "").lower().split())
    present = [f for f in CPU_FLAGS if f in flags]
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    return [("CPU", model), ("Architecture", platform.machine()),
            ("Logical cores", f"{os.cpu_count()}" + (f" ({affinity} usable by this process)"
                                                      if affinity else "")),
            ("SIMD flags", " ".join(present) or "none of " + " ".join(CPU_FLAGS))]


def torch_section() -> list[tuple[str, Any]]:
    import torch

    rows: list[tuple[str, Any]] = [
        ("PyTorch", torch.__version__),
        ("Built with CUDA", torch.version.cuda or "no"),
        ("Built with HIP", getattr(torch.version, "hip", None) or "no"),
        ("Debug build", torch.version.debug),
        ("CPU capability", _safe(torch.backends.cpu.get_cpu_capability)),
        ("Threads", torch.get_num_threads()),
    ]
    if torch.backends.cudnn.is_available():
        rows.append(("cuDNN", torch.backends.cudnn.version()))
    return rows


def gpu_section() -> list[tuple[str, Any]]:
    smi = _run(["nvidia-smi", "--query-gpu=index,name,memory.total,driver_version",
                "--format=csv,noheader"])
    if smi:
        return [(f"GPU {line.split(',')[0].strip()}", line.split(",", 1)[1].strip())
                for line in smi.splitlines()]
    rocm = _run(["rocm-smi", "--showproductname"])
    if rocm:
        return [("ROCm GPUs", rocm)]
    import torch

    # is_available() asks the driver for a count without creating a context: safe without one.
    if not (torch.version.cuda or getattr(torch.version, "hip", None)):
        return [("GPUs", "none (this torch is a CPU build)")]
    if not torch.cuda.is_available():
        return [("GPUs", "none visible to torch")]
    return [(f"GPU {i}", torch.cuda.get_device_name(i)) for i in range(torch.cuda.device_count())]


def platform_section() -> list[tuple[str, Any]]:
    from ember.platforms import choose_platform

    name, index, why = choose_platform(None)
    return [("Chosen platform", name + (f":{index}" if index is not None else ""))] + \
        [("  why", line) for line in why]


def env_section() -> list[tuple[str, Any]]:
    names = sorted(k for k in os.environ if k.startswith("EMBER_")) + \
        [k for k in OTHER_ENV if k in os.environ]
    if not names:
        return [("(none set)", "")]
    return [(k, "***" if _SECRET.search(k) else os.environ[k]) for k in names]


def sections() -> list[tuple[str, list[tuple[str, Any]] | list[str]]]:
    import ember

    def ember_rows() -> list[tuple[str, Any]]:
        return [("ember", getattr(ember, "__version__", "dev")),
                ("Installed at", os.path.dirname(os.path.abspath(ember.__file__)))]

    def system_rows() -> list[tuple[str, Any]]:
        return [("Python", sys.version.replace("\n", " ")), ("Executable", sys.executable),
                ("OS", platform.platform()),
                ("libc", " ".join(platform.libc_ver()) or "unknown")]

    def plugin_lines() -> list[str]:
        from ember.entrypoints.cli_plugins import listing

        return listing()

    builders: list[tuple[str, Callable[[], Any]]] = [
        ("ember", ember_rows), ("System", system_rows), ("CPU", cpu_section),
        ("PyTorch", torch_section), ("GPUs", gpu_section),
        ("Packages", lambda: [(p, _version(p)) for p in PACKAGES]),
        ("Platform", platform_section), ("Plugins", plugin_lines),
        ("Environment variables", env_section),
    ]
    out = []
    for title, build in builders:
        value = _safe(build)
        out.append((title, value if isinstance(value, list) else [("error", value)]))
    return out


def render() -> str:
    lines: list[str] = []
    for title, rows in sections():
        lines += ["", f"== {title} =="]
        if rows and isinstance(rows[0], str):
            lines += list(rows)  # already laid out (the plugin listing)
            continue
        width = max((len(k) for k, _ in rows), default=0)
        lines += [f"{k.ljust(width)} : {v}" if v != "" else k for k, v in rows]
    return "\n".join(lines).lstrip("\n")


def cmd_collect_env(ns: argparse.Namespace) -> int:
    print(render(), flush=True)
    return 0


def add_subparser(subparsers: Any) -> None:
    parser = subparsers.add_parser("collect-env",
                                   help="print the environment for a bug report")
    parser.set_defaults(func=cmd_collect_env)
