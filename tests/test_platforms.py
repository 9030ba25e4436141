"""Platform selection (explicit, out-of-tree, built-in; ambiguity; unavailable choices), the
CUDA/ROCm probes, and attention-backend selection with its explanation."""

from __future__ import annotations

import sys
import types

import pytest

from ember import registry as reg
from ember.attention_backends.selector import (
    explain_attention_backend,
    rank_attention_backends,
    select_attention_backend,
)
from ember.platforms import choose_platform, explain_platform, probe_platform, resolve_platform
from ember.platforms.cpu import CpuPlatform
from ember.platforms.cuda import CudaPlatform, cuda_status
from ember.registry import AttentionBackendRegistry, PlatformRegistry


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    for var in ("EMBER_PLATFORM", "EMBER_ATTENTION_BACKEND", "EMBER_CPU_VARIANT",
                "TRITON_INTERPRET"):
        monkeypatch.delenv(var, raising=False)
    with reg.isolated():
        yield


# A fake out-of-tree platform module: probes read a flag so tests switch them on and off.
fake = types.ModuleType("fake_oot_platforms")
fake.ON = {"alpha": True, "beta": False}


class AlphaPlatform(CpuPlatform):
    name = "alpha"
    preferred_attention_backends = ["alpha_attn", "sdpa"]


class BetaPlatform(CpuPlatform):
    name = "beta"


def _probe(name):
    return lambda: (fake.ON[name], f"{name} switched off")


fake.AlphaPlatform, fake.BetaPlatform = AlphaPlatform, BetaPlatform
fake.alpha_probe, fake.beta_probe = _probe("alpha"), _probe("beta")
fake.raising_probe = lambda: 1 / 0
sys.modules["fake_oot_platforms"] = fake


def _register(name, cls="AlphaPlatform"):
    with reg.registering_as(f"{name}-dist", "0.3", name):
        PlatformRegistry.register_platform(name, f"fake_oot_platforms:{cls}",
                                           probe=f"fake_oot_platforms:{name}_probe")


def test_builtin_default_is_cpu_here():
    assert isinstance(resolve_platform(), CpuPlatform)
    lines = explain_platform()
    assert any("platform cuda (built-in): unavailable" in x for x in lines)
    assert lines[-1].startswith("platform cpu: chosen")


def test_explicit_device_and_env(monkeypatch):
    platform = resolve_platform("cpu:0")
    assert platform.name == "cpu" and platform.device_index == 0
    assert str(platform.device()) == "cpu:0"
    with pytest.raises(ValueError, match="unknown platform 'tpu'.*known: cpu, .*cuda, .*rocm"):
        resolve_platform("tpu")
    with pytest.raises(ValueError, match="platform 'cuda' .* is not available: "):
        resolve_platform("cuda")
    with pytest.raises(ValueError, match="rocm.*not available.*AMD GPU"):
        resolve_platform("rocm")
    monkeypatch.setenv("EMBER_PLATFORM", "nope")
    with pytest.raises(ValueError, match="from EMBER_PLATFORM='nope'"):
        resolve_platform()


def test_the_one_available_oot_platform_wins():
    fake.ON.update(alpha=True, beta=False)
    _register("alpha")
    _register("beta", "BetaPlatform")
    name, _, lines = choose_platform()
    assert name == "alpha"
    assert "platform beta (out-of-tree, beta-dist 0.3): unavailable: beta switched off" in lines
    assert resolve_platform().name == "alpha"
    assert resolve_platform("cpu").name == "cpu"  # an explicit choice still wins


def test_two_available_oot_platforms_is_an_error_naming_both():
    fake.ON.update(alpha=True, beta=True)
    _register("alpha")
    _register("beta", "BetaPlatform")
    with pytest.raises(ValueError) as err:
        resolve_platform()
    msg = str(err.value)
    assert "'alpha' (alpha-dist 0.3)" in msg and "'beta' (beta-dist 0.3)" in msg
    assert "device=" in msg and "EMBER_PLATFORM" in msg
    assert resolve_platform("beta").name == "beta"


def test_raising_probe_means_unavailable_with_reason(caplog):
    PlatformRegistry.register_platform("raising", "fake_oot_platforms:BetaPlatform",
                                       probe="fake_oot_platforms:raising_probe")
    ok, reason = probe_platform("raising")
    assert not ok and "ZeroDivisionError" in reason
    assert "raising" in caplog.text
    assert resolve_platform().name == "cpu"


def test_probe_without_probe_capability_uses_the_class():
    PlatformRegistry.register_platform("classy", AlphaPlatform)
    assert probe_platform("classy") == (True, "")


def test_cuda_probe_does_not_import_torch_and_honours_visible_devices(monkeypatch):
    import subprocess

    code = ("import sys; from ember.platforms.cuda import cuda_status; s = cuda_status(); "
            "print(s[0], 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.split()[-1] == "False"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert cuda_status() == (False, "CUDA_VISIBLE_DEVICES hides every GPU")


def test_cuda_kv_cache_budget(monkeypatch):
    import torch

    gib = 1 << 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (60 * gib, 80 * gib))
    assert CudaPlatform().kv_cache_memory_bytes(0.9) == 72 * gib - 20 * gib
    with pytest.raises(ValueError, match="no GPU memory left"):
        CudaPlatform().kv_cache_memory_bytes(0.2)


# ---- attention-backend selection ---------------------------------------------------------


def test_cpu_picks_sdpa_and_explains():
    assert select_attention_backend(CpuPlatform(), dtype="float32", head_size=64).name == "sdpa"
    lines = explain_attention_backend(CpuPlatform(), dtype="float32", head_size=64)
    assert "sdpa: chosen (#1 in cpu's preference)" in lines
    assert any(x.startswith("triton: rejected, runs on ['cuda']") for x in lines)


class GpuLike(CudaPlatform):
    """A CUDA-like platform of its own device type, so only the test's backends fit it (the
    built-ins' order and capabilities are tuned from GPU measurements and may change)."""

    name = "gpu_like"
    device_type = "gpu_like"
    preferred_attention_backends = ["fast", "general", "ref"]


def _register_gpu_backends():
    AttentionBackendRegistry.register_backend(
        "fast", "m:Fast", devices=["gpu_like"], dtypes=["float16", "bfloat16"],
        head_sizes=[64, 128, 256], cuda_graphs=True, requires=["fast_kernels_pkg"])
    AttentionBackendRegistry.register_backend(
        "general", "m:General", devices=["gpu_like"], dtypes=["float32", "float16", "bfloat16"],
        head_sizes=[16, 32, 64, 128, 256], sliding_window=True, cuda_graphs=True)
    AttentionBackendRegistry.register_backend(
        "ref", "m:Ref", devices=["gpu_like"], dtypes=["float32", "float16", "bfloat16"],
        sliding_window=True)


def test_platform_order_and_capability_rejections(monkeypatch):
    _register_gpu_backends()
    gpu = GpuLike()
    monkeypatch.setattr("ember.attention_backends.selector._module_missing", lambda m: False)
    name, lines = rank_attention_backends(gpu, dtype="bf16", head_size=128)
    assert name == "fast"
    assert "general [user]: suitable, but fast comes first (#2 in gpu_like's preference)" in lines
    assert any(x.startswith("sdpa: rejected, runs on ['cpu', 'cuda']") for x in lines)
    name, lines = rank_attention_backends(gpu, dtype="float32", head_size=128)
    assert name == "general" and any("fast [user]: rejected, dtype float32" in x for x in lines)
    name, lines = rank_attention_backends(gpu, dtype="bfloat16", head_size=96)
    assert name == "ref" and any("general [user]: rejected, head size 96" in x for x in lines)
    name, _ = rank_attention_backends(gpu, dtype="bfloat16", head_size=128, sliding_window=True)
    assert name == "general"
    with pytest.raises(ValueError, match="no attention backend can run this model"):
        rank_attention_backends(gpu, dtype="float32", head_size=96, need_cuda_graphs=True)


def test_missing_module_rejects_without_importing():
    _register_gpu_backends()
    name, lines = rank_attention_backends(GpuLike(), dtype="bf16", head_size=128)
    assert name == "general"
    assert "fast [user]: rejected, needs fast_kernels_pkg, not installed" in lines


def test_builtin_cuda_candidates_are_all_considered(monkeypatch):
    monkeypatch.setattr("ember.attention_backends.selector._module_missing", lambda m: False)
    name, lines = rank_attention_backends(CudaPlatform(), dtype="bf16", head_size=128)
    assert name == CudaPlatform.preferred_attention_backends[0]
    for backend in ("flashinfer", "triton", "sdpa"):
        assert any(x.startswith(backend + ":") for x in lines)


def test_override_argument_and_env(monkeypatch):
    cpu = CpuPlatform()
    with pytest.raises(ValueError, match="unknown attention backend 'nope' .*known: .*sdpa"):
        select_attention_backend(cpu, dtype="float32", head_size=64, override="nope")
    with pytest.raises(ValueError, match="'triton' .*cannot be used on platform cpu: runs on"):
        select_attention_backend(cpu, dtype="float32", head_size=64, override="triton")
    monkeypatch.setenv("EMBER_ATTENTION_BACKEND", "flashinfer")
    with pytest.raises(ValueError, match="from EMBER_ATTENTION_BACKEND='flashinfer'"):
        select_attention_backend(cpu, dtype="float32", head_size=64)
    monkeypatch.setenv("EMBER_ATTENTION_BACKEND", "sdpa")
    lines = explain_attention_backend(cpu, dtype="float32", head_size=64)
    assert lines[-1] == "sdpa: chosen, because EMBER_ATTENTION_BACKEND='sdpa'"


def test_triton_allowed_on_cpu_under_the_interpreter(monkeypatch):
    cpu = CpuPlatform()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    name, _ = rank_attention_backends(cpu, dtype="float32", head_size=64, override="triton")
    assert name == "triton"
    # ...but never chosen on the CPU without being asked for (not in cpu's preference).
    assert rank_attention_backends(cpu, dtype="float32", head_size=64)[0] == "sdpa"


def test_oot_backend_by_platform_preference_then_priority():
    AttentionBackendRegistry.register_backend("alpha_attn", "m:A", devices=["alpha"],
                                              dtypes=["float32"])
    AttentionBackendRegistry.register_backend("fast_cpu", "m:F", devices=["cpu"],
                                              dtypes=["float32"], priority=50)
    alpha = AlphaPlatform()  # device type cpu, platform name alpha, prefers alpha_attn
    name, lines = rank_attention_backends(alpha, dtype="float32", head_size=64)
    assert name == "alpha_attn"
    assert "fast_cpu [user]: suitable, but alpha_attn comes first (priority 50)" in lines
    # On plain cpu alpha_attn does not run; sdpa is cpu's preference, fast_cpu comes after it.
    name, lines = rank_attention_backends(CpuPlatform(), dtype="float32", head_size=64)
    assert name == "sdpa" and any(x.startswith("alpha_attn [user]: rejected") for x in lines)


def test_unregistered_preferred_backend_is_skipped_with_a_note():
    class Odd(CpuPlatform):
        name = "odd"
        preferred_attention_backends = ["ghost", "sdpa"]

    name, lines = rank_attention_backends(Odd(), dtype="float32", head_size=64)
    assert name == "sdpa"
    assert "ghost: skipped, preferred by odd but not registered" in lines


def test_cpu_kv_cache_sized_from_available_not_free_memory(tmp_path, monkeypatch):
    # Page cache counts as available: a machine whose RAM is mostly cached model files still
    # gets the full 4 GiB KV cache, not a quarter of its few free pages.
    from ember.platforms import cpu

    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 25165824 kB\nMemFree: 1048576 kB\nMemAvailable: 20971520 kB\n")
    assert cpu.available_host_memory_bytes(str(meminfo)) == 20 << 30
    monkeypatch.setattr(cpu, "available_host_memory_bytes", lambda: 20 << 30)
    assert CpuPlatform().kv_cache_memory_bytes(0.9) == 4 << 30
    monkeypatch.setattr(cpu, "available_host_memory_bytes", lambda: 8 << 30)
    assert CpuPlatform().kv_cache_memory_bytes(0.9) == 2 << 30
