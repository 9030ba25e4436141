"""ember-cpu-variant: its probe, platform selection with it, and its backend against SDPA."""

import pytest

from ember.attention_backends.selector import select_attention_backend
from ember.platforms import resolve_platform
from ember.registry import AttentionBackendRegistry
from ember.testing import check_attention_backend


def test_off_by_default_so_it_never_hijacks_selection(monkeypatch):
    monkeypatch.delenv("EMBER_CPU_VARIANT", raising=False)
    assert resolve_platform().name == "cpu"
    with pytest.raises(ValueError, match="set EMBER_CPU_VARIANT=1"):
        resolve_platform("cpu_variant")


def test_when_enabled_it_is_the_platform_and_brings_its_backend(monkeypatch):
    monkeypatch.setenv("EMBER_CPU_VARIANT", "1")
    platform = resolve_platform()
    assert platform.name == "cpu_variant" and platform.device_type == "cpu"
    backend = select_attention_backend(platform, dtype="bfloat16", head_size=64)
    assert backend.name == "cpu_variant_sdpa"
    # Its backend declares the platform's name as its device: plain cpu never picks it.
    cpu = resolve_platform("cpu")
    assert select_attention_backend(cpu, dtype="bfloat16", head_size=64).name == "sdpa"


def test_backend_matches_sdpa():
    backend = AttentionBackendRegistry.resolve("cpu_variant_sdpa")
    check_attention_backend(backend, dtypes=("float32", "bfloat16"),
                            grid={"heads": ((4, 2), (4, 1)), "sliding_windows": (None, 5)})
