"""The kernels' place in the layering: ember.kernels imports no layer or attention backend, and
layers and backends reach kernels only through ember.kernels (not through each other's old
kernel modules, which remain as deprecated aliases)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

EMBER = Path(__file__).resolve().parents[1] / "ember"
ALIASES = {EMBER / "layers" / "fused_ops.py", *(EMBER / "attention_backends" / "triton_ops").glob("*.py")}


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def _violations(package: str, forbidden: tuple[str, ...]) -> list[str]:
    found = []
    for path in sorted((EMBER / package).rglob("*.py")):
        if path in ALIASES:
            continue
        for name in _imports(path):
            if name.startswith(forbidden):
                found.append(f"{path.relative_to(EMBER.parent)} imports {name}")
    return found


@pytest.mark.parametrize("package,forbidden", [
    ("kernels", ("ember.layers", "ember.attention_backends", "ember.models", "ember.worker")),
    ("layers", ("ember.attention_backends.triton_ops", "ember.layers.fused_ops")),
    ("attention_backends", ("ember.layers.fused_ops", "ember.attention_backends.triton_ops")),
])
def test_kernel_layering(package, forbidden):
    assert _violations(package, forbidden) == []
