"""ember's import structure: no import cycle at module level, no import against the layering, and
no use of a deprecated module path by ember's own code.

Imports are read with `ast`, never executed. For cycles only module-level imports count (those
run when a module is imported; an import inside a function is the lazy-loading mechanism, and
`if TYPE_CHECKING:` imports never run). The layering rules below may also forbid imports inside
functions, where a lazy import would still be a dependency in the wrong direction.

The rules are data: adjust RULES as packages move. A rule naming a package that does not exist
matches nothing. An exemption lets one module make one import a rule forbids, and says why; its
module must exist, so no exemption outlives the module it was made for.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

ROOT_PACKAGE = "ember"
SOURCE = Path(__file__).resolve().parents[1] / ROOT_PACKAGE

MODULE_LEVEL, ANYWHERE = "module level", "anywhere"


@dataclass(frozen=True)
class Exemption:
    """Modules under `importer` may import modules under `target` although the rule forbids it."""

    importer: str
    target: str
    why: str


@dataclass(frozen=True)
class Rule:
    """Modules under `importer` may not import modules under any of `forbidden` (except those
    under `allowed`, and the imports `exempt` lists), at module level or `anywhere`."""

    importer: str
    forbidden: tuple[str, ...]
    why: str
    allowed: tuple[str, ...] = ()
    scope: str = ANYWHERE
    exempt: tuple[Exemption, ...] = ()

    def exempts(self, imp: Import) -> bool:
        return any(_under(imp.importer, e.importer) and _under(imp.target, e.target)
                   for e in self.exempt)


# Deprecated aliases: old import paths kept for plugins, each re-exporting a name's new home.
KERNEL_ALIASES = ("ember.layers.fused_ops", "ember.attention_backends.triton_ops")
ENGINE_ALIASES = ("ember.core.engine", "ember.core.async_engine")

RULES: list[Rule] = [
    Rule("ember.kernels",
         ("ember.layers", "ember.attention_backends", "ember.models", "ember.worker",
          "ember.executor", "ember.core", "ember.engine", "ember.entrypoints"),
         "kernels are the bottom layer: layers and backends import kernels, never the reverse"),
    Rule("ember.core", ("ember.worker", "ember.executor", "ember.entrypoints", "ember.engine"),
         "the engine core reaches its executor through ember.registry.ExecutorRegistry and "
         "knows no front end",
         exempt=tuple(
             Exemption(alias, "ember.engine",
                       "deprecated alias: its module __getattr__ re-exports the moved front-end "
                       "name from ember.engine, lazily, with a DeprecationWarning")
             for alias in ENGINE_ALIASES)),
    Rule("ember", KERNEL_ALIASES,
         "deprecated kernel paths are for plugins only: ember's own code imports ember.kernels",
         exempt=tuple(
             Exemption(alias, alias, "the deprecated alias itself (a package's modules import "
                                     "one another)")
             for alias in KERNEL_ALIASES)),
    Rule("ember.layers", ("ember.attention_backends",),
         "layers reach backends only through the contract (attention_backends.base); "
         "kernels both use live in ember.kernels",
         allowed=("ember.attention_backends.base",)),
    Rule("ember.attention_backends", ("ember.layers",),
         "backends sit below layers; kernels both use live in ember.kernels"),
    Rule("ember.registry", ("ember.plugins",),
         "registries know nothing of plugins: the plugin loader registers into "
         "ember.registry.hooks"),
]


@dataclass(frozen=True)
class Import:
    importer: str
    target: str
    file: str
    line: int
    module_level: bool


@dataclass
class ImportGraph:
    modules: dict[str, Path] = field(default_factory=dict)
    imports: list[Import] = field(default_factory=list)


def _module_name(path: Path, root: Path, package: str) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([package, *parts])


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports_of(tree: ast.Module) -> list[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Every import statement with whether it runs when the module is imported."""
    found: list[tuple[ast.Import | ast.ImportFrom, bool]] = []

    def visit(node: ast.AST, module_level: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                found.append((child, module_level))
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                visit(child, False)
            elif isinstance(child, ast.If) and _is_type_checking(child.test):
                for stmt in child.body:
                    visit(ast.Module(body=[stmt], type_ignores=[]), False)
                for stmt in child.orelse:
                    visit(ast.Module(body=[stmt], type_ignores=[]), module_level)
            else:
                visit(child, module_level)

    visit(tree, True)
    return found


def _resolve(node: ast.Import | ast.ImportFrom, importer: str, is_package: bool,
             modules: dict[str, Path], package: str) -> list[str]:
    """The modules of `package` a statement imports (`from a import b` is a.b when b is a
    module, else a)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.split(".")[0] == package]
    base = node.module or ""
    if node.level:
        anchor = importer.split(".") if is_package else importer.split(".")[:-1]
        anchor = anchor[: len(anchor) - (node.level - 1)]
        base = ".".join(anchor + ([base] if base else []))
    if base.split(".")[0] != package:
        return []
    targets = []
    for alias in node.names:
        sub = f"{base}.{alias.name}"
        targets.append(sub if sub in modules else base)
    return targets


def build_graph(root: Path = SOURCE, package: str = ROOT_PACKAGE) -> ImportGraph:
    graph = ImportGraph()
    for path in sorted(root.rglob("*.py")):
        graph.modules[_module_name(path, root, package)] = path
    for name, path in graph.modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node, module_level in _imports_of(tree):
            for target in _resolve(node, name, path.name == "__init__.py", graph.modules,
                                   package):
                graph.imports.append(Import(name, target, str(path.relative_to(root.parent)),
                                            node.lineno, module_level))
    return graph


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def _ancestors(module: str) -> list[str]:
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def module_level_edges(graph: ImportGraph) -> dict[str, dict[str, Import]]:
    """importer -> {imported module: first import} for imports that run at import time. Importing
    a.b.c runs a.b first, so parent packages count too, except the importer's own ancestors (a
    package importing its submodules is how packages work) and the root package."""
    edges: dict[str, dict[str, Import]] = {m: {} for m in graph.modules}
    for imp in graph.imports:
        if not imp.module_level:
            continue
        own = set(_ancestors(imp.importer))
        for target in [*_ancestors(imp.target)[1:], imp.target]:
            if target != imp.importer and target not in own and target in graph.modules:
                edges[imp.importer].setdefault(target, imp)
    return edges


def find_cycles(graph: ImportGraph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each as a path."""
    edges = module_level_edges(graph)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def strongconnect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in edges.get(node, {}):
            if succ not in index:
                strongconnect(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for module in sorted(edges):
        if module not in index:
            strongconnect(module)
    return components


def describe_cycle(graph: ImportGraph, component: list[str]) -> str:
    edges = module_level_edges(graph)
    members = set(component)
    lines = [f"import cycle among {', '.join(component)}:"]
    for module in component:
        for target, imp in sorted(edges[module].items()):
            if target in members:
                lines.append(f"  {imp.file}:{imp.line}  {module} -> {target}")
    return "\n".join(lines)


def find_violations(graph: ImportGraph, rules: list[Rule] = RULES) -> list[str]:
    found = []
    for imp in graph.imports:
        for rule in rules:
            if not _under(imp.importer, rule.importer):
                continue
            if rule.scope == MODULE_LEVEL and not imp.module_level:
                continue
            if any(_under(imp.target, f) for f in rule.forbidden) and not any(
                    _under(imp.target, a) for a in rule.allowed) and not rule.exempts(imp):
                where = "module level" if imp.module_level else "inside a function"
                found.append(f"{imp.file}:{imp.line}  {imp.importer} imports {imp.target} "
                             f"({where}): {rule.why}")
    return sorted(set(found))


# ---- the checks on ember ---------------------------------------------------------------------

def test_no_import_cycle_at_module_level():
    graph = build_graph()
    cycles = find_cycles(graph)
    assert not cycles, "\n\n".join(describe_cycle(graph, c) for c in cycles)


def test_no_import_against_the_layering():
    violations = find_violations(build_graph())
    assert not violations, "imports against the layering:\n" + "\n".join(violations)


def test_every_exemption_names_an_existing_module():
    modules = build_graph().modules
    stale = [e.importer for rule in RULES for e in rule.exempt if e.importer not in modules]
    assert not stale, f"exemptions for modules that do not exist: {stale}"


# ---- the checker itself, on a small package ------------------------------------------------

def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "pkg"
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_checker_finds_module_level_cycles_and_ignores_lazy_and_type_checking_imports(tmp_path):
    root = _package(tmp_path, {
        "__init__.py": "",
        "a.py": "from pkg import b\n",
        "b.py": "import pkg.c\n",
        "c.py": "from . import a\n",
        "lazy.py": "def f():\n    from pkg import lazy2\n",
        "lazy2.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import lazy\n"
                    "def g():\n    import pkg.lazy\n",
    })
    graph = build_graph(root, "pkg")
    assert find_cycles(graph) == [["pkg.a", "pkg.b", "pkg.c"]]
    assert "pkg/c.py:1  pkg.c -> pkg.a" in describe_cycle(graph, ["pkg.a", "pkg.b", "pkg.c"])


def test_checker_counts_a_parent_package_run_by_a_submodule_import(tmp_path):
    root = _package(tmp_path, {
        "__init__.py": "",
        "reg/__init__.py": "from pkg.reg import base\n",
        "reg/base.py": "",
        "plug.py": "from pkg.reg import base\n",
        "reg/uses_plug.py": "",
    })
    (root / "reg" / "__init__.py").write_text("from pkg.reg import base\nimport pkg.plug\n")
    cycles = find_cycles(build_graph(root, "pkg"))
    assert cycles == [["pkg.plug", "pkg.reg"]]


def test_checker_applies_rules_by_scope_and_exceptions(tmp_path):
    root = _package(tmp_path, {
        "__init__.py": "",
        "low/__init__.py": "",
        "low/k.py": "def f():\n    import pkg.high.x\n",
        "high/__init__.py": "",
        "high/x.py": "from pkg.low import base\n",
        "low/base.py": "",
    })
    graph = build_graph(root, "pkg")
    anywhere = [Rule("pkg.low", ("pkg.high",), "low is below high")]
    assert find_violations(graph, anywhere) == [
        "pkg/low/k.py:2  pkg.low.k imports pkg.high.x (inside a function): low is below high"]
    module_level = [Rule("pkg.low", ("pkg.high",), "low is below high", scope=MODULE_LEVEL)]
    assert find_violations(graph, module_level) == []
    allowed = [Rule("pkg.high", ("pkg.low",), "x", allowed=("pkg.low.base",))]
    assert find_violations(graph, allowed) == []
    missing = [Rule("pkg.not_yet", ("pkg.high",), "a package that does not exist")]
    assert find_violations(graph, missing) == []
    exempt = [Rule("pkg.low", ("pkg.high",), "low is below high",
                   exempt=(Exemption("pkg.low.k", "pkg.high.x", "an alias"),))]
    assert find_violations(graph, exempt) == []
    other_target = [Rule("pkg.low", ("pkg.high",), "low is below high",
                         exempt=(Exemption("pkg.low.k", "pkg.high.y", "an alias"),))]
    assert len(find_violations(graph, other_target)) == 1
