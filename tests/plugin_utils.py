"""Helpers for the plugin-system tests: run Python in a fresh process, and make plugins visible
to importlib-metadata without touching the venv (a directory of *.dist-info + modules put on
PYTHONPATH is exactly what `pip install --target` produces)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples" / "plugins"
EXAMPLE_DISTS = ("ember-olmo", "ember-paged-torch", "ember-cpu-variant")


def clean_env(**extra: str) -> dict[str, str]:
    """os.environ without EMBER_* plugin/platform settings, plus `extra`."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("EMBER_PLUGINS", "EMBER_PLUGINS_STRICT", "EMBER_PLATFORM",
                        "EMBER_ATTENTION_BACKEND", "EMBER_CPU_VARIANT", "PYTHONPATH")}
    env.update(extra)
    return env


def run_py(code: str, *, path: list[str | Path] = (), check: bool = True,
           **env: str) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter (the repo and `path` first on sys.path)."""
    pythonpath = os.pathsep.join([str(p) for p in path] + [str(REPO)])
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
        env=clean_env(PYTHONPATH=pythonpath, **env), cwd=str(REPO), timeout=300,
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"subprocess failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
        )
    return proc


def last_json(proc: subprocess.CompletedProcess) -> object:
    return json.loads(proc.stdout.strip().splitlines()[-1])


def write_plugin(site: Path, dist: str, entry_points: dict[str, str],
                 modules: dict[str, str], version: str = "1.0") -> None:
    """A fake installed distribution under `site`: its modules and a dist-info with entry
    points in the ``ember.plugins`` group."""
    for name, source in modules.items():
        file = site / (name.replace(".", "/") + ".py")
        file.parent.mkdir(parents=True, exist_ok=True)
        file.write_text(textwrap.dedent(source))
    info = site / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    lines = "".join(f"{name} = {value}\n" for name, value in entry_points.items())
    (info / "entry_points.txt").write_text(f"[ember.plugins]\n{lines}")


def pip_install_target(package_dir: Path, target: Path) -> None:
    """`pip install --target` a copy of an example package (the source tree stays clean)."""
    src = target.parent / (package_dir.name + "-src")
    shutil.copytree(package_dir, src, ignore=shutil.ignore_patterns("build", "*.egg-info"))
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
         "--no-index", "--target", str(target), str(src)],
        check=True, capture_output=True, text=True, timeout=600,
    )


def examples_installed() -> bool:
    import importlib.metadata as md

    try:
        for dist in EXAMPLE_DISTS:
            md.distribution(dist)
    except md.PackageNotFoundError:
        return False
    return True
