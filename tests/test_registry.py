"""The lazy registries: registration rules, lookups, capabilities, and the snapshot/restore
hand-off to worker processes (with a real spawned worker)."""

from __future__ import annotations

import json
import multiprocessing
import pickle
import sys

import pytest
from plugin_utils import REPO, last_json, run_py

from ember import registry as reg
from ember.registry import (
    AttentionBackendRegistry,
    ModelRegistry,
    PlatformRegistry,
    QuantizationRegistry,
    registering_as,
)


class TinyUserModel:
    """A "model class" defined in user code (this test module), registered as an object."""

    marker = "tiny-user-model"


@pytest.fixture(autouse=True)
def _isolated():
    with reg.isolated():
        yield


def test_builtins_listed_without_importing_anything():
    proc = run_py("""
        import json, sys
        from ember.registry import REGISTRIES
        names = {k: r.names() for k, r in REGISTRIES.items()}
        heavy = [m for m in sys.modules if m == "torch" or m.startswith(("ember.models.",
                 "ember.attention_backends.", "ember.platforms.", "transformers"))]
        print(json.dumps({"names": names, "heavy": heavy}))
    """)
    out = last_json(proc)
    assert {"LlamaForCausalLM", "Qwen3ForCausalLM"} <= set(out["names"]["models"])
    assert {"sdpa", "triton", "flashinfer"} <= set(out["names"]["attention_backends"])
    assert {"cpu", "cuda", "rocm"} <= set(out["names"]["platforms"])
    assert out["heavy"] == []


def test_register_model_by_path_and_by_class():
    ModelRegistry.register_model("PathArch", "tests_fake_module:Nothing")
    ModelRegistry.register_model("ClassArch", TinyUserModel)
    assert {"PathArch", "ClassArch"} <= set(ModelRegistry.get_supported_archs())
    assert ModelRegistry.resolve("ClassArch") is TinyUserModel
    entry = ModelRegistry.entry("ClassArch")
    assert entry.owner == "user" and entry.target.endswith(":TinyUserModel")
    cls, arch = ModelRegistry.resolve_model_cls(["Unknown", "ClassArch"])
    assert (cls, arch) == (TinyUserModel, "ClassArch")
    with pytest.raises(ImportError, match="PathArch.*tests_fake_module"):
        ModelRegistry.resolve("PathArch")
    with pytest.raises(ValueError, match="not supported.*LlamaForCausalLM"):
        ModelRegistry.resolve_model_cls(["Nope"])


def test_unknown_name_lists_known_names():
    with pytest.raises(ValueError, match="unknown attention backend 'nope'.*sdpa"):
        AttentionBackendRegistry.entry("nope")


def test_registering_existing_name_needs_override_and_names_both_owners():
    with registering_as("acme-models", "2.0", "acme"):
        with pytest.raises(ValueError) as err:
            ModelRegistry.register_model("LlamaForCausalLM", "acme.llama:Llama")
    message = str(err.value)
    assert "already registered by ember" in message and "acme-models 2.0" in message
    assert "override=True" in message
    with registering_as("acme-models", "2.0", "acme"):
        entry = ModelRegistry.register_model("LlamaForCausalLM", "acme.llama:Llama", override=True)
    assert entry.overrides == "ember" and entry.owner == "acme-models"
    assert ModelRegistry.entry("LlamaForCausalLM").target == "acme.llama:Llama"


def test_same_owner_same_target_is_idempotent_but_a_different_target_is_not():
    ModelRegistry.register_model("Again", TinyUserModel)
    ModelRegistry.register_model("Again", TinyUserModel)  # re-running a notebook cell
    with pytest.raises(ValueError, match="already registered by user"):
        ModelRegistry.register_model("Again", "other.module:Other")


def test_target_and_capability_validation():
    with pytest.raises(ValueError, match="module:attr"):
        ModelRegistry.register_model("Bad", "no_colon_here")
    with pytest.raises(ValueError, match="unknown attention-backend capabilities.*'devcies'"):
        AttentionBackendRegistry.register("x", "m:X", capabilities={"devcies": ["cpu"]})
    with pytest.raises(ValueError, match="'dtypes' is required|capability 'dtypes'"):
        AttentionBackendRegistry.register("x", "m:X", capabilities={"devices": ["cpu"]})
    with pytest.raises(ValueError, match="unknown dtype"):
        AttentionBackendRegistry.register_backend("x", "m:X", devices=["cpu"], dtypes=["fp8"])
    with pytest.raises(ValueError, match="JSON-like"):
        QuantizationRegistry.register_quantization_method("q", "m:Q", table=object())
    with pytest.raises(ValueError, match="probe"):
        PlatformRegistry.register_platform("p", "m:P", probe="not-a-path")


def test_backend_capabilities_are_normalised():
    entry = AttentionBackendRegistry.register_backend(
        "mine", "m:Mine", devices=["cpu"], dtypes=("fp16", "bf16"), head_sizes=[64])
    assert entry.capabilities == {
        "devices": ["cpu"], "dtypes": ["float16", "bfloat16"], "head_sizes": [64],
        "sliding_window": False, "cuda_graphs": False, "priority": 0, "requires": [],
        "env_devices": {}, "kv_cache_dtypes": ["auto"],
    }


def test_isolated_undoes_registrations():
    with reg.isolated():
        ModelRegistry.register_model("Temporary", "m:T")
        assert "Temporary" in ModelRegistry
    assert "Temporary" not in ModelRegistry


def test_snapshot_is_json_and_pickle_safe_and_restores():
    ModelRegistry.register_model("ClassArch", TinyUserModel)
    snap = reg.snapshot()
    assert json.loads(json.dumps(snap)) == snap
    assert pickle.loads(pickle.dumps(snap)) == snap
    targets = {e["name"]: e for e in snap["registries"]["models"]}
    assert targets["ClassArch"]["target"] == f"{__name__}:TinyUserModel"
    assert targets["ClassArch"]["unimportable"] is None
    ModelRegistry.register_model("Later", "m:Later")
    reg.restore(snap)
    assert "Later" not in ModelRegistry and ModelRegistry.resolve("ClassArch") is TinyUserModel


def test_snapshot_marks_classes_a_worker_cannot_import():
    class Local:  # defined in a function: no process can import it by name
        pass

    ModelRegistry.register_model("LocalArch", Local)
    snap = reg.snapshot()
    entry = next(e for e in snap["registries"]["models"] if e["name"] == "LocalArch")
    assert "inside a function" in entry["unimportable"]
    ModelRegistry._resolved.pop("LocalArch")  # as in a fresh worker
    reg.restore(snap)
    with pytest.raises(ImportError, match="cannot be imported in this process.*inside a function"):
        ModelRegistry.resolve("LocalArch")


def test_restore_rejects_another_format():
    with pytest.raises(ValueError, match="format"):
        reg.restore({"format": 999})


def _worker(snap: dict, queue) -> None:
    """Runs in a spawned process: restore the parent's registries, resolve the user model."""
    from ember import plugins, registry

    registry.restore(snap)
    cls = registry.ModelRegistry.resolve("UserArch")
    loaded_plugin_modules = sorted(m for m in sys.modules if m.startswith("ember_"))
    queue.put({"marker": cls.marker, "module": cls.__module__,
               "report": plugins.get_report().to_dict(),
               "plugin_modules": loaded_plugin_modules,
               "archs": registry.ModelRegistry.get_supported_archs()})


def test_spawned_worker_resolves_a_model_registered_in_user_code():
    ModelRegistry.register_model("UserArch", TinyUserModel)
    snap = reg.snapshot()
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_worker, args=(snap, queue))
    proc.start()
    result = queue.get(timeout=120)
    proc.join(timeout=60)
    assert proc.exitcode == 0
    assert result["marker"] == "tiny-user-model"
    assert "UserArch" in result["archs"]
    # The worker adopted the parent's plugin report: it did not discover/import plugins again.
    assert result["report"] == snap["plugins"]
    assert result["plugin_modules"] == []


SCRIPT = '''
import multiprocessing, sys
from ember import registry
from ember.registry import ModelRegistry

class ScriptModel:
    answer = 42

def worker(snap, queue):
    registry.restore(snap)
    try:
        queue.put(ModelRegistry.resolve("ScriptArch").answer)
    except ImportError as exc:
        queue.put(str(exc))

if __name__ == "__main__":
    ModelRegistry.register_model("ScriptArch", ScriptModel)
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    p = ctx.Process(target=worker, args=(registry.snapshot(), queue))
    p.start()
    print(queue.get(timeout=120))
    p.join()
'''


def test_class_in_a_main_script_reaches_a_spawned_worker(tmp_path):
    script = tmp_path / "user_script.py"
    script.write_text(SCRIPT)
    proc = run_py(f"import runpy; runpy.run_path({str(script)!r}, run_name='__main__')")
    assert proc.stdout.strip().splitlines()[-1] == "42", proc.stdout + proc.stderr


def test_class_in_interactive_main_is_reported_clearly():
    proc = run_py("""
        from ember import registry
        from ember.registry import ModelRegistry
        class Repl:
            pass
        ModelRegistry.register_model("ReplArch", Repl)
        snap = registry.snapshot()
        entry = next(e for e in snap["registries"]["models"] if e["name"] == "ReplArch")
        print(entry["unimportable"])
    """)
    assert "interactive __main__" in proc.stdout


def test_repo_is_on_path():  # the helpers above rely on it
    assert (REPO / "ember" / "registry" / "__init__.py").exists()


# ---- executors, capabilities as the one truth, the hook point ------------------------------

def test_executor_registry_has_the_in_process_executor_without_importing_it():
    proc = run_py("""
        import json, sys
        from ember.registry import ExecutorRegistry, REGISTRIES
        entry = ExecutorRegistry.entry("uni")
        print(json.dumps([entry.target, entry.owner, REGISTRIES["executors"] is ExecutorRegistry,
                          "ember.executor.uniproc" in sys.modules]))
    """)
    assert last_json(proc) == ["ember.executor.uniproc:UniProcExecutor", "ember", True, False]


def test_user_executor_registration_and_snapshot():
    from ember.registry import ExecutorRegistry

    ExecutorRegistry.register_executor("mine", TinyUserModel)
    assert "mine" in ExecutorRegistry.get_supported_executors()
    snap = reg.snapshot()
    assert {e["name"] for e in snap["registries"]["executors"]} >= {"uni", "mine"}


def _backend_class(**attrs):
    from ember.attention_backends.base import AttentionBackend

    return type("GraphBackend", (AttentionBackend,), attrs)


def test_class_attribute_that_contradicts_the_registration_is_an_error():
    cls = _backend_class(supports_cuda_graphs=True)
    with pytest.raises(ValueError, match="supports_cuda_graphs=True.*cuda_graphs=False"):
        AttentionBackendRegistry.register_backend("contradicts", cls, devices=["cpu"],
                                                  dtypes=["float32"])
    assert "contradicts" not in AttentionBackendRegistry
    entry = AttentionBackendRegistry.register_backend("agrees", cls, devices=["cpu"],
                                                      dtypes=["float32"], cuda_graphs=True)
    assert entry.capabilities["cuda_graphs"] is True


def test_class_attribute_left_at_the_contract_default_is_derived_from_the_registration():
    cls = _backend_class()
    AttentionBackendRegistry.register_backend("derived", cls, devices=["cuda"],
                                              dtypes=["float16"], cuda_graphs=True)
    assert cls.supports_cuda_graphs is True  # what the engine reads agrees with selection


def test_builtin_and_example_classes_agree_with_their_registrations():
    for name in ("sdpa", "triton", "flashinfer"):
        cls = AttentionBackendRegistry.resolve(name)
        assert cls.supports_cuda_graphs == AttentionBackendRegistry.entry(name).capabilities[
            "cuda_graphs"]
    for name in ("cpu", "cuda", "rocm"):
        cls = PlatformRegistry.resolve(name)
        assert cls.device_type == PlatformRegistry.entry(name).capabilities["device_type"]


def test_platform_device_type_must_agree():
    from ember.platforms.base import Platform

    cls = type("OddPlatform", (Platform,), {"name": "odd", "device_type": "xpu"})
    with pytest.raises(ValueError, match="device_type='xpu'.*device_type='cpu'"):
        PlatformRegistry.register_platform("odd", cls, device_type="cpu")


def test_registry_hook_point_runs_before_reads_and_carries_snapshot_sections():
    from ember.registry import hooks

    calls = []
    seen = {}

    def note() -> None:
        calls.append(1)

    hooks.add_before_read(note)
    hooks.add_snapshot_section("test_section", lambda: {"x": 1}, seen.update)
    try:
        ModelRegistry.names()
        assert calls
        snap = reg.snapshot()
        assert snap["test_section"] == {"x": 1} and "plugins" in snap
        reg.restore(snap)
        assert seen == {"x": 1}
    finally:
        hooks.remove_before_read(note)
        hooks._sections.pop("test_section")


def test_legacy_before_read_assignment_still_runs_with_a_deprecation_warning():
    from ember.registry.base import LazyRegistry

    calls = []
    LazyRegistry.before_read = lambda: calls.append(1)
    LazyRegistry._before_read_warned = False
    try:
        with pytest.warns(DeprecationWarning, match="hooks.add_before_read"):
            ModelRegistry.names()
        assert calls
    finally:
        LazyRegistry.before_read = None
