"""Plugin discovery and loading: entry points, attribution, failure isolation and rollback,
allowlist, strict mode, once-per-process loading, the hook contract, and `ember plugins`.

Plugins here are fake distributions written to a temporary directory put on PYTHONPATH (what
`pip install --target` produces), loaded in fresh processes; the example plugins of
examples/plugins are used where installed (scripts/setup.sh installs them)."""

from __future__ import annotations

import json

import pytest
from plugin_utils import (
    EXAMPLES,
    examples_installed,
    last_json,
    pip_install_target,
    run_py,
    write_plugin,
)

REPORT = """
    import json
    from ember.plugins import load_plugins
    from ember.registry import REGISTRIES
    report = load_plugins()
    entries = {k: {e.name: [e.owner, e.version, e.plugin] for e in r.entries() if not e.builtin}
               for k, r in REGISTRIES.items()}
    print(json.dumps({"report": report.to_dict(), "entries": entries}))
"""

GOOD = """
    from ember.plugins import hookimpl
    CALLS = []

    @hookimpl
    def ember_register_models(registry):
        CALLS.append("models")
        registry.register_model("GoodForCausalLM", "good_impl:Good")

    @hookimpl
    def ember_register_attention_backends(registry, api_version):
        registry.register_backend("good_attn", "good_impl:Attn", devices=["cpu"],
                                  dtypes=["float32"], priority=api_version)
"""
# registers one model, then fails: its registration must be rolled back.
RAISES = """
    from ember.plugins import hookimpl

    @hookimpl
    def ember_register_models(registry):
        registry.register_model("HalfDoneForCausalLM", "half:Done")
        raise RuntimeError("boom in a hook")
"""
BAD_SIGNATURE = """
    from ember.plugins import hookimpl

    @hookimpl
    def ember_register_models(registry, not_an_argument):
        pass
"""
CONFLICT = """
    from ember.plugins import hookimpl

    @hookimpl
    def ember_register_models(registry):
        registry.register_model("LlamaForCausalLM", "conflict:Llama")
"""
OVERRIDE = """
    from ember.plugins import hookimpl

    @hookimpl
    def ember_register_models(registry):
        registry.register_model("MistralForCausalLM", "override_impl:Mistral", override=True)
"""
FUTURE_HOOK = """
    from ember.plugins import hookimpl

    @hookimpl
    def ember_register_models(registry):
        registry.register_model("FutureForCausalLM", "future:F")

    @hookimpl
    def ember_register_tokenizers(registry):  # a hook from a newer ember
        pass
"""
VLLM_STYLE = """
    def register():
        from ember.registry import ModelRegistry
        ModelRegistry.register_model("VllmStyleForCausalLM", "vllm_style_impl:M")
"""


@pytest.fixture
def site(tmp_path):
    write_plugin(tmp_path, "good-plugin", {"good": "good_plugin"}, {"good_plugin": GOOD}, "1.2")
    write_plugin(tmp_path, "raising-plugin", {"raising": "raising_plugin"},
                 {"raising_plugin": RAISES})
    write_plugin(tmp_path, "badsig-plugin", {"badsig": "badsig_plugin"},
                 {"badsig_plugin": BAD_SIGNATURE})
    write_plugin(tmp_path, "conflict-plugin", {"conflict": "conflict_plugin"},
                 {"conflict_plugin": CONFLICT})
    write_plugin(tmp_path, "override-plugin", {"override": "override_plugin"},
                 {"override_plugin": OVERRIDE})
    write_plugin(tmp_path, "future-plugin", {"future": "future_plugin"},
                 {"future_plugin": FUTURE_HOOK})
    write_plugin(tmp_path, "vllm-style", {"vllm_style": "vllm_style_plugin:register"},
                 {"vllm_style_plugin": VLLM_STYLE})
    write_plugin(tmp_path, "missing-module", {"missing": "module_that_does_not_exist"}, {})
    return tmp_path


FAKE = "good,raising,badsig,conflict,override,future,vllm_style,missing"


def _load(site, **env):
    env.setdefault("EMBER_PLUGINS", FAKE)
    out = last_json(run_py(REPORT, path=[site], **env))
    return {p["name"]: p for p in out["report"]["plugins"]}, out["entries"]


def test_each_plugin_loads_in_isolation_and_is_attributed(site):
    plugins, entries = _load(site)
    assert plugins["good"]["status"] == "loaded"
    assert (plugins["good"]["dist"], plugins["good"]["version"]) == ("good-plugin", "1.2")
    assert sorted(plugins["good"]["registered"]) == ["attention_backends:good_attn",
                                                     "models:GoodForCausalLM"]
    assert entries["models"]["GoodForCausalLM"] == ["good-plugin", "1.2", "good"]
    assert entries["attention_backends"]["good_attn"][0] == "good-plugin"
    assert plugins["vllm_style"]["status"] == "loaded"
    assert entries["models"]["VllmStyleForCausalLM"][0] == "vllm-style"


def test_failures_are_recorded_with_tracebacks_and_rolled_back(site):
    plugins, entries = _load(site)
    raising = plugins["raising"]
    assert raising["status"] == "failed"
    assert raising["error"] == "RuntimeError: boom in a hook"
    assert "Traceback" in raising["traceback"] and "raising_plugin.py" in raising["traceback"]
    assert "HalfDoneForCausalLM" not in entries["models"]  # rolled back
    assert plugins["missing"]["status"] == "failed"
    assert plugins["missing"]["error"].startswith("ModuleNotFoundError")
    assert plugins["badsig"]["status"] == "failed"
    assert "not_an_argument" in plugins["badsig"]["error"]


def test_conflict_with_builtin_fails_the_plugin_naming_both(site):
    plugins, entries = _load(site)
    error = plugins["conflict"]["error"]
    assert "'LlamaForCausalLM' is already registered by ember" in error
    assert "conflict-plugin 1.0" in error and "override=True" in error
    assert "LlamaForCausalLM" not in entries["models"]  # still ember's
    assert plugins["override"]["status"] == "loaded"
    assert entries["models"]["MistralForCausalLM"][0] == "override-plugin"


def test_unknown_hook_is_a_warning_not_a_failure(site):
    plugins, entries = _load(site)
    future = plugins["future"]
    assert future["status"] == "loaded"
    assert any("ember_register_tokenizers" in w for w in future["warnings"])
    assert "FutureForCausalLM" in entries["models"]


def test_failure_is_logged_once_clearly(site):
    proc = run_py("""
        import logging
        logging.basicConfig()
        from ember.plugins import load_plugins
        from ember.registry import ModelRegistry
        load_plugins(); load_plugins()
        ModelRegistry.names(); "x" in ModelRegistry
    """, path=[site], EMBER_PLUGINS="raising")
    assert proc.stderr.count("failed to load") == 1
    assert "'raising' (raising-plugin 1.0" in proc.stderr and "boom in a hook" in proc.stderr


def test_plugins_load_once_per_process(site):
    proc = run_py("""
        import json
        from ember.plugins import load_plugins
        from ember.registry import ModelRegistry
        first = load_plugins()
        ModelRegistry.names(); ModelRegistry.register_model("Mine", "m:Mine")
        import good_plugin
        print(json.dumps([load_plugins() is first, good_plugin.CALLS]))
    """, path=[site], EMBER_PLUGINS="good")
    assert last_json(proc) == [True, ["models"]]


def test_registry_access_loads_plugins_before_user_registrations(site):
    proc = run_py("""
        from ember.registry import ModelRegistry
        ModelRegistry.register_model("Mine", "m:Mine")  # triggers plugin loading first
        print(ModelRegistry.entry("GoodForCausalLM").owner)
    """, path=[site], EMBER_PLUGINS="good")
    assert proc.stdout.strip() == "good-plugin"


def test_allowlist_empty_means_none_and_imports_nothing(site):
    proc = run_py("""
        import json, sys
        from ember.plugins import load_plugins
        r = load_plugins()
        print(json.dumps([[p.name, p.status] for p in r.plugins if p.name in
                          ("good", "raising")], ) )
        print(json.dumps(sorted(m for m in sys.modules if m.endswith("_plugin"))))
    """, path=[site], EMBER_PLUGINS="")
    statuses = json.loads(proc.stdout.splitlines()[0])
    assert statuses == [["good", "skipped"], ["raising", "skipped"]]
    assert last_json(proc) == []


def test_allowlist_by_entry_point_or_distribution_name_and_missing_names(site):
    plugins, entries = _load(site, EMBER_PLUGINS="good-plugin, vllm_style, nonexistent")
    assert plugins["good"]["status"] == "loaded"
    assert plugins["vllm_style"]["status"] == "loaded"
    assert plugins["raising"]["status"] == "skipped"
    assert plugins["nonexistent"]["status"] == "missing"


def test_strict_mode_makes_a_failure_fatal(site):
    proc = run_py("""
        from ember.plugins import load_plugins, PluginLoadError
        for _ in range(2):  # stays fatal on every call
            try:
                load_plugins()
            except PluginLoadError as exc:
                print("fatal:", str(exc).splitlines()[0])
    """, path=[site], EMBER_PLUGINS="good,raising", EMBER_PLUGINS_STRICT="1")
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 2 and all("'raising'" in x and "boom in a hook" in x for x in lines)
    ok = run_py(REPORT, path=[site], EMBER_PLUGINS="good", EMBER_PLUGINS_STRICT="1")
    statuses = {p["name"]: p["status"] for p in last_json(ok)["report"]["plugins"]}
    assert statuses["good"] == "loaded" and statuses["raising"] == "skipped"
    missing = run_py("""
        from ember.plugins import load_plugins, PluginLoadError
        try:
            load_plugins()
        except PluginLoadError as exc:
            print(exc)
    """, path=[site], EMBER_PLUGINS="nonexistent", EMBER_PLUGINS_STRICT="1")
    assert "not installed" in missing.stdout


def test_cli_lists_plugins_and_their_errors(site):
    proc = run_py("from ember.entrypoints.cli_plugins import main; main([])", path=[site],
                  EMBER_PLUGINS="good,raising")
    out = proc.stdout
    assert "good-plugin 1.2" in out
    assert "raising" in out and "FAILED" in out and "RuntimeError: boom in a hook" in out
    assert "GoodForCausalLM" in out and "good_impl:Good" in out
    verbose = run_py("from ember.entrypoints.cli_plugins import main; main(['-v'])",
                     path=[site], EMBER_PLUGINS="raising").stdout
    assert "traceback of raising" in verbose and "raising_plugin.py" in verbose
    data = json.loads(run_py("from ember.entrypoints.cli_plugins import main; main(['--json'])",
                             path=[site], EMBER_PLUGINS="good").stdout)
    good = next(p for p in data["plugins"]["plugins"] if p["name"] == "good")
    assert (good["dist"], good["status"]) == ("good-plugin", "loaded")
    assert any(e["name"] == "GoodForCausalLM" for e in data["registries"]["models"])


CLI = "import sys; from ember.entrypoints.cli_plugins import main; sys.exit(main({args!r}))"


def test_strict_mode_log_line_says_the_failure_is_fatal(site):
    proc = run_py("""
        import logging
        logging.basicConfig()
        from ember.plugins import load_plugins, PluginLoadError
        try:
            load_plugins()
        except PluginLoadError:
            print("raised")
    """, path=[site], EMBER_PLUGINS="raising", EMBER_PLUGINS_STRICT="1")
    assert proc.stdout.strip() == "raised"
    assert "failed to load" in proc.stderr and "makes this fatal" in proc.stderr
    assert "disabled" not in proc.stderr and "unaffected" not in proc.stderr


def test_check_exits_nonzero_when_a_plugin_failed(site):
    failed = run_py(CLI.format(args=["--check"]), path=[site], check=False,
                    EMBER_PLUGINS="raising")
    assert failed.returncode == 1 and "boom in a hook" in failed.stdout
    clean = run_py(CLI.format(args=["--check"]), path=[site], check=False, EMBER_PLUGINS="")
    assert clean.returncode == 0, clean.stdout + clean.stderr
    listing = run_py(CLI.format(args=[]), path=[site], check=False, EMBER_PLUGINS="raising")
    assert listing.returncode == 0  # a listing reports; --check is the gate


def test_check_exits_nonzero_when_an_entry_does_not_import(site):
    proc = run_py(CLI.format(args=["--check"]), path=[site], check=False, EMBER_PLUGINS="good")
    assert proc.returncode == 1  # good_impl:Good is not a module
    assert "IMPORT ERROR" in proc.stdout


def test_tracebacks_are_shown_only_with_verbose(site):
    plain = run_py(CLI.format(args=[]), path=[site], EMBER_PLUGINS="raising")
    assert "Traceback" not in plain.stdout + plain.stderr
    assert "RuntimeError: boom in a hook" in plain.stdout  # the one-line reason
    assert plain.stderr.count("failed to load") == 1 and "-v" in plain.stderr
    verbose = run_py(CLI.format(args=["-v"]), path=[site], EMBER_PLUGINS="raising")
    assert "Traceback" in verbose.stdout and "raising_plugin.py" in verbose.stdout


@pytest.mark.parametrize("arch, fields", [
    # config.json without head_dim: the engine's config (AutoConfig) fills Qwen3's default, 128
    ("qwen3", {"hidden_size": 64, "num_attention_heads": 2}),
    # head_dim differs from hidden_size // num_attention_heads (64 // 4 = 16)
    ("qwen3", {"hidden_size": 64, "num_attention_heads": 4, "head_dim": 32}),
    # no head_dim anywhere: hidden_size // num_attention_heads = 32
    ("llama", {"hidden_size": 64, "num_attention_heads": 2}),
])
def test_explain_derives_the_head_size_the_engine_builds(tmp_path, arch, fields):
    """`--explain --model DIR` must name the head size of the model the engine would build."""
    import torch
    import transformers

    from ember.attention_backends.sdpa import SdpaBackend
    from ember.model_resolution import load_hf_config
    from ember.registry import ModelRegistry

    config = {"architectures": [f"{arch.capitalize()}ForCausalLM"], "model_type": arch,
              "vocab_size": 128, "intermediate_size": 64, "num_hidden_layers": 1,
              "num_key_value_heads": 1, **fields}
    (tmp_path / "config.json").write_text(json.dumps(config))
    hf_config = load_hf_config(str(tmp_path))[0]
    with torch.device("meta"):
        model = ModelRegistry.resolve(config["architectures"][0])(hf_config, SdpaBackend)
    assert isinstance(hf_config, transformers.PretrainedConfig)
    proc = run_py(f"""
        from ember.entrypoints.cli_plugins import main
        main(["--explain", "--model", {str(tmp_path)!r}, "--device", "cpu"])
    """, EMBER_PLUGINS="")
    assert f"model needs: dtype float32, head size {model.head_size}" in proc.stdout, proc.stdout
    assert "assuming" not in proc.stdout


# ---- the example plugins (examples/plugins), as installed by examples/plugins/install.sh ----

needs_examples = pytest.mark.skipif(not examples_installed(),
                                    reason="run examples/plugins/install.sh first")


@pytest.fixture(scope="session")
def broken_site(tmp_path_factory):
    """The example broken plugin, really pip-installed, into a directory of its own (installing
    it into the venv would make every ember process log its failure)."""
    target = tmp_path_factory.mktemp("broken") / "site"
    pip_install_target(EXAMPLES / "ember-broken-plugin", target)
    return target


@needs_examples
def test_listing_imports_no_plugin_implementation_module():
    proc = run_py("""
        import json, sys
        from ember.entrypoints.cli_plugins import listing
        text = "\\n".join(listing())
        mods = sorted(m for m in sys.modules if m.split(".")[0] in
                      ("ember_olmo", "ember_paged_torch", "ember_cpu_variant"))
        print(json.dumps({"mods": mods, "torch": "torch" in sys.modules,
                          "ok": all(n in text for n in ("OlmoForCausalLM", "paged_torch",
                                                         "cpu_variant_sdpa", "cpu_variant"))}))
    """)
    out = last_json(proc)
    assert out["ok"] and not out["torch"]
    # Only each plugin's registration module (the entry point) and its empty package.
    assert out["mods"] == ["ember_cpu_variant", "ember_cpu_variant.plugin", "ember_olmo",
                           "ember_olmo.plugin", "ember_paged_torch", "ember_paged_torch.plugin"]


@needs_examples
def test_broken_example_plugin_is_reported_and_others_keep_working(broken_site):
    proc = run_py("""
        import json
        from ember.entrypoints.cli_plugins import main
        main([])
        from ember.registry import ModelRegistry, AttentionBackendRegistry
        print(json.dumps([ModelRegistry.resolve("OlmoForCausalLM").__name__,
                          AttentionBackendRegistry.resolve("paged_torch").__name__]))
    """, path=[broken_site])
    out = proc.stdout
    assert "broken" in out and "ember-broken-plugin 0.1.0" in out and "FAILED" in out
    assert "ModuleNotFoundError: No module named 'ember_dependency_that_is_not_installed'" in out
    assert "3 loaded, 1 failed" in out
    assert last_json(proc) == ["OlmoForCausalLM", "PagedTorchBackend"]
    assert proc.stderr.count("failed to load") == 1


@needs_examples
def test_broken_example_plugin_in_strict_mode_is_fatal(broken_site):
    proc = run_py("import sys; from ember.entrypoints.cli_plugins import main; sys.exit(main([]))",
                  path=[broken_site], check=False, EMBER_PLUGINS_STRICT="1")
    assert proc.returncode != 0
    assert "PluginLoadError" in proc.stderr and "EMBER_PLUGINS_STRICT=1" in proc.stderr
    assert "Traceback" not in proc.stderr  # one line without -v


@needs_examples
def test_explain_with_the_example_platform():
    off = run_py("from ember.entrypoints.cli_plugins import main; main(['--explain', "
                 "'--model', 'LlamaForCausalLM', '--head-size', '64'])").stdout
    assert "cpu_variant (out-of-tree, ember-cpu-variant 0.1.0): unavailable: set " \
           "EMBER_CPU_VARIANT=1" in off
    assert "platform cpu: chosen" in off and "sdpa: chosen" in off
    on = run_py("from ember.entrypoints.cli_plugins import main; main(['--explain', "
                "'--model', 'LlamaForCausalLM', '--head-size', '64'])",
                EMBER_CPU_VARIANT="1").stdout
    assert "platform cpu_variant: chosen, the one available out-of-tree platform" in on
    assert "cpu_variant_sdpa [ember-cpu-variant 0.1.0]: chosen" in on


def test_explain_reads_a_gguf_model_without_importing_torch():
    from ember.default_model import default_model_path

    try:
        path = default_model_path()
    except Exception as exc:  # the embedded model is installed by scripts/setup.sh
        pytest.skip(f"default model not installed: {exc}")
    proc = run_py(f"""
        import json, sys
        from ember.entrypoints.cli_plugins import explain
        lines, ok = explain({path!r}, None, "auto", None, None)
        print(json.dumps([ok, "torch" in sys.modules, lines]))
    """)
    ok, torch_imported, lines = last_json(proc)
    assert ok and not torch_imported
    assert "model: LlamaForCausalLM -> ember.models.llama:LlamaForCausalLM (ember)" in lines
    assert "  model needs: dtype float32, head size 64" in lines


def test_registration_module_importing_torch_gets_a_warning(tmp_path):
    write_plugin(tmp_path, "heavy-plugin", {"heavy": "heavy_plugin"}, {"heavy_plugin": """
        import torch  # noqa: F401  (what not to do in a registration module)
        from ember.plugins import hookimpl

        @hookimpl
        def ember_register_models(registry):
            registry.register_model("HeavyForCausalLM", "heavy_impl:H")
    """})
    plugins, _ = _load(tmp_path, EMBER_PLUGINS="heavy")
    assert plugins["heavy"]["status"] == "loaded"
    assert any("imported torch" in w for w in plugins["heavy"]["warnings"])


def test_a_plugin_registers_an_executor_through_its_hook(tmp_path):
    write_plugin(tmp_path, "exec-plugin", {"execp": "execp_plugin"}, {"execp_plugin": """
        from ember.plugins import hookimpl

        @hookimpl
        def ember_register_executors(registry, api_version):
            registry.register_executor("remote", "execp_impl:RemoteExecutor")
    """})
    plugins, entries = _load(tmp_path, EMBER_PLUGINS="execp")
    assert plugins["execp"]["status"] == "loaded" and not plugins["execp"]["warnings"]
    assert plugins["execp"]["registered"] == ["executors:remote"]
    assert entries["executors"]["remote"] == ["exec-plugin", "1.0", "execp"]
