"""`ember plugins`: what is installed, who provides it, and what would be chosen and why.

    ember plugins                       every plugin (with its load status and error) and every
                                        model, attention backend, quantization method, platform
    ember plugins --check               also import each entry; exits 1 if a plugin failed
                                        or an entry does not import
    ember plugins --json                the same as data
    ember plugins --explain [--model PATH_OR_ARCH] [--device X] [--dtype D] [--attention-backend B]
                                        the platform and attention backend that would be chosen

The listing imports neither torch nor any plugin module beyond its registration module. A
failed plugin shows as one line (its error); -v adds its traceback. In strict mode
(EMBER_PLUGINS_STRICT=1) a failure ends the command with exit status 1.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

_TITLES = {"models": "Models", "attention_backends": "Attention backends",
           "quantization_methods": "Quantization methods", "platforms": "Platforms",
           "executors": "Executors", "logits_processors": "Logits processors",
           "grammar_backends": "Grammar backends (structured outputs)",
           "tool_parsers": "Tool-call parsers", "reasoning_parsers": "Reasoning parsers",
           "poolers": "Poolers (pooling models)"}


def add_subparser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "plugins", help="list plugins and registries; --explain the platform/backend choice",
        description=__doc__.split("\n\n")[1] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--explain", action="store_true",
                        help="say which platform and attention backend would be chosen, and why")
    parser.add_argument("--model", default=None,
                        help="with --explain: an HF directory, a .gguf file or an architecture")
    parser.add_argument("--device", default=None, help="with --explain: a platform name")
    parser.add_argument("--dtype", default="auto", help="with --explain: the model dtype")
    parser.add_argument("--head-size", type=int, default=None,
                        help="with --explain and an architecture name: the head size")
    parser.add_argument("--attention-backend", default=None,
                        help="with --explain: an attention backend override to check")
    parser.add_argument("--check", action="store_true",
                        help="also import every entry (imports torch) and report failures")
    parser.add_argument("--json", action="store_true", help="print the listing as JSON")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="print failed plugins' full tracebacks (else one line each)")
    parser.set_defaults(func=run)
    return parser


def _ember_version() -> str:
    import ember

    return str(getattr(ember, "__version__", "dev"))


def _provider(entry: Any, version: str) -> str:
    return f"ember {version}" if entry.builtin else entry.provider


def _table(rows: list[list[str]], indent: str = "  ") -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [indent + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
            for r in rows]


def _caps_text(kind: str, caps: dict[str, Any]) -> str:
    if kind == "attention_backends":
        heads = caps["head_sizes"] if caps["head_sizes"] == "any" else \
            ",".join(map(str, caps["head_sizes"]))
        extra = [f for f in ("sliding_window", "cuda_graphs") if caps.get(f)]
        dtypes = "/".join(d.replace("float", "f") for d in caps["dtypes"])
        kv = [d for d in caps.get("kv_cache_dtypes", ["auto"]) if d != "auto"]
        return (f"{'/'.join(caps['devices'])} {dtypes} heads={heads} prio={caps['priority']}"
                + (f" +{'+'.join(extra)}" if extra else "")
                + (f" kv={','.join(kv)}" if kv else ""))
    if kind == "quantization_methods" and "platforms" in caps:
        dtypes = "/".join(d.replace("float", "f") for d in caps["dtypes"])
        reads = ",".join(caps["checkpoint_formats"]) or "float weights (quantized at load)"
        if caps["checkpoint_formats"] and caps.get("quantizes_float"):
            reads += " or float weights"
        return f"{'/'.join(caps['platforms'])} {dtypes} {'/'.join(caps['layer_kinds'])} reads={reads}"
    return " ".join(f"{k}={v}" for k, v in caps.items() if k != "probe")


IMPORT_OK = "imports ok"


def _import_status(reg: Any, name: str) -> str:
    try:
        reg.resolve(name)
    except Exception as exc:  # the point is to report it
        return f"IMPORT ERROR: {type(exc).__name__}: {exc}".splitlines()[0]
    return IMPORT_OK


def listing(check: bool = False, verbose: bool = False) -> list[str]:
    return listing_and_status(check, verbose)[0]


def listing_and_status(check: bool = False, verbose: bool = False) -> tuple[list[str], bool]:
    """The listing's lines, and False when a plugin failed (or, with `check`, an entry does not
    import): what `--check` turns into its exit status."""
    from ember.plugins import load_plugins
    from ember.registry import REGISTRIES

    report = load_plugins()
    ok = report.ok
    version = _ember_version()
    out = [f"ember {version}; plugins (entry-point group 'ember.plugins'): {report.summary()}"]
    if report.allowlist is not None:
        out.append(f"  EMBER_PLUGINS={','.join(report.allowlist)!r}")
    if report.plugins:
        rows = [["PLUGIN", "DISTRIBUTION", "STATUS", "REGISTERED / ERROR"]]
        for p in report.plugins:
            detail = p.error if p.error else ", ".join(p.registered) or "-"
            rows.append([p.name, p.provider, p.status.upper() if p.error else p.status, detail])
        out += _table(rows)
        for p in report.plugins:
            out += [f"  warning: {p.name}: {w}" for w in p.warnings]
            if verbose and p.traceback:
                out += ["", f"  traceback of {p.name}:"] + \
                    ["    " + line for line in p.traceback.rstrip().splitlines()]
    for kind, reg in REGISTRIES.items():
        entries = reg.entries()
        out += ["", f"{_TITLES[kind]} ({len(entries)})"]
        if not entries:
            out.append("  (none)")
            continue
        rows = [["NAME", "PROVIDED BY", "TARGET", "DECLARES"] + (["STATUS"] if check else [])]
        for e in entries:
            provider = _provider(e, version)
            if e.overrides:
                provider += f" (overrides {e.overrides})"
            row = [e.name, provider, e.target, _caps_text(kind, e.capabilities)]
            if check:
                status = _import_status(reg, e.name)
                ok = ok and status == IMPORT_OK
                row.append(status)
            rows.append(row)
        out += _table(rows)
    if not verbose and any(p.traceback for p in report.plugins):
        out += ["", "(-v shows the failed plugins' tracebacks)"]
    return out, ok


def listing_json() -> dict[str, Any]:
    from ember.registry import snapshot

    snap = snapshot()
    return {"ember_version": _ember_version(), "plugins": snap["plugins"],
            "registries": snap["registries"]}


def head_size_of(cfg: Any) -> int | None:
    """The head size the built-in models use: `head_dim` when the config gives one, else
    hidden_size // num_attention_heads (None when the config has neither)."""
    size = getattr(cfg, "head_dim", None)
    if size:
        return int(size)
    heads, hidden = getattr(cfg, "num_attention_heads", None), getattr(cfg, "hidden_size", None)
    return int(hidden) // int(heads) if heads and hidden else None


def _dir_config(model_dir: str, notes: list[str]) -> Any:
    """The config of an HF directory read as the engine reads it (transformers' AutoConfig,
    whose per-architecture defaults fill fields config.json leaves out); the raw config.json
    when transformers cannot read it."""
    from types import SimpleNamespace

    from ember.model_resolution import load_hf_config

    try:
        return load_hf_config(model_dir)[0]
    except (ImportError, ValueError) as exc:
        notes.append(f"config read as plain JSON (transformers could not: {exc})")
        with open(os.path.join(model_dir, "config.json")) as f:
            return SimpleNamespace(**json.load(f))


def _model_facts(model: str | None, head_size: int | None) -> tuple[dict[str, Any], list[str]]:
    """arch, config dtype, head size and sliding window of --model (a GGUF is read without
    torch; a directory as the engine reads it)."""
    from types import SimpleNamespace

    from ember.registry import ModelRegistry

    notes: list[str] = []
    cfg: Any = None
    if model is None:
        try:
            from ember.model_resolution import resolve_model_path

            model = resolve_model_path(None)
            notes.append(f"model: the embedded default ({model})")
        except Exception as exc:
            notes.append(f"model: none given and the default is not available ({exc})")
    if model and model.endswith(".gguf") and os.path.isfile(model):
        cfg = _gguf_config(model)
    elif model and os.path.isdir(model):
        cfg = _dir_config(model, notes)
    elif model and model not in ModelRegistry and "/" in model:
        from ember.model_resolution import resolve_model_path  # a hub name: its config, cached

        cfg = _dir_config(resolve_model_path(model, progress=False), notes)
    elif model:
        if model not in ModelRegistry:
            raise ValueError(f"--model {model!r} is neither a model directory, a .gguf file, a "
                             "hub name nor a registered architecture "
                             f"({', '.join(ModelRegistry.names())})")
        cfg = SimpleNamespace(architectures=[model])
    archs = list(getattr(cfg, "architectures", None) or [])
    size = head_size or (head_size_of(cfg) if cfg is not None else None)
    if size is None:
        size = 64
        notes.append("head size unknown (give --head-size or a model path): assuming 64")
    window = getattr(cfg, "sliding_window", None)
    use_window = bool(window) and getattr(cfg, "use_sliding_window", True) is not False
    return {"archs": archs, "config": cfg or SimpleNamespace(), "head_size": int(size),
            "sliding_window": use_window}, notes


def _gguf_config(path: str) -> Any:
    """The facts explain needs from a GGUF header, without transformers (seconds faster);
    the loader's own gguf_hf_config when its architecture table is not there to read."""
    from types import SimpleNamespace

    from ember.models.loader import gguf

    header = gguf.read_gguf_header(path)
    arch, meta = header.architecture, header.metadata
    spec = getattr(gguf, "_ARCHS", {}).get(arch)
    if spec is None:
        return gguf.gguf_hf_config(path)  # raises the loader's "cannot load" error
    _, hf_arch, head_dim_key = spec
    return SimpleNamespace(
        architectures=[hf_arch],
        num_attention_heads=meta.get(f"{arch}.attention.head_count"),
        hidden_size=meta.get(f"{arch}.embedding_length"),
        head_dim=meta.get(f"{arch}.{head_dim_key}") if head_dim_key else None,
        sliding_window=meta.get(f"{arch}.attention.sliding_window"),
    )


def explain(model: str | None, device: str | None, dtype: str, head_size: int | None,
            backend: str | None) -> tuple[list[str], bool]:
    """Lines saying what would be chosen and why; False when something would fail."""
    from ember.attention_backends.selector import rank_attention_backends
    from ember.model_resolution import resolve_dtype
    from ember.platforms import choose_platform
    from ember.registry import ModelRegistry, PlatformRegistry

    out: list[str] = []
    ok = True
    facts, notes = _model_facts(model, head_size)
    out += notes
    arch = next((a for a in facts["archs"] if a in ModelRegistry), None)
    if facts["archs"]:
        if arch is None:
            out.append(f"model: architectures {facts['archs']} are NOT supported")
            return out, False
        entry = ModelRegistry.entry(arch)
        out.append(f"model: {arch} -> {entry.target} ({entry.provider})")
    out += ["", "Platform:"]
    try:
        name, _, why = choose_platform(device)
    except ValueError as exc:
        out.append(f"  error: {exc}")
        requested = (device or "").partition(":")[0]
        if requested not in PlatformRegistry:
            return out, False
        # Still useful to plugin authors: what would be chosen on that platform.
        name, why = requested, [f"explaining as if platform {requested} were available"]
        ok = False
    out += ["  " + line for line in why]
    platform = PlatformRegistry.resolve(name)()
    try:
        chosen_dtype = resolve_dtype(dtype, facts["config"], platform)
    except ValueError as exc:
        return out + [f"  error: {exc}"], False
    out += ["", f"Attention backend (dtype {chosen_dtype}"
                + (" from --dtype" if dtype != "auto" else f", {name}'s default for dtype=auto")
                + "):"]
    try:
        _, why = rank_attention_backends(
            platform, dtype=chosen_dtype, head_size=facts["head_size"],
            sliding_window=facts["sliding_window"], override=backend,
        )
    except ValueError as exc:
        return out + ["  error: " + str(exc).replace("\n", "\n  ")], False
    return out + ["  " + line for line in why], ok


def _print(text: str) -> None:
    try:
        print(text, flush=True)
    except BrokenPipeError:  # `ember plugins | head`: not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def run(ns: argparse.Namespace) -> int:
    from ember.plugins import PluginLoadError

    try:
        if ns.explain:
            lines, ok = explain(ns.model, ns.device, ns.dtype, ns.head_size, ns.attention_backend)
            _print("\n".join(lines))
            return 0 if ok else 1
        if ns.json:
            _print(json.dumps(listing_json(), indent=2))
            return 0
        lines, ok = listing_and_status(check=ns.check, verbose=ns.verbose)
    except PluginLoadError as exc:  # strict mode: a plugin failed
        text = str(exc) if ns.verbose else str(exc).splitlines()[0] + " (-v: traceback)"
        print(f"ember plugins: PluginLoadError: {text}", file=sys.stderr)
        return 1
    _print("\n".join(lines))
    return 0 if ok or not ns.check else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ember")
    add_subparser(parser.add_subparsers(dest="command", required=True))
    return run(parser.parse_args(["plugins", *(sys.argv[1:] if argv is None else argv)]))


if __name__ == "__main__":
    sys.exit(main())
