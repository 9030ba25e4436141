"""ember-paged-torch against ember's SDPA reference, through the conformance kit."""

from ember.registry import AttentionBackendRegistry
from ember.testing import AttentionGrid, check_attention_backend


def backend():
    return AttentionBackendRegistry.resolve("paged_torch")  # registered by the installed plugin


def test_registration_declares_its_capabilities():
    entry = AttentionBackendRegistry.entry("paged_torch")
    assert entry.owner == "ember-paged-torch"
    assert entry.capabilities["devices"] == ["cpu", "cuda"]
    assert entry.capabilities["sliding_window"] is True


def test_matches_sdpa_float32_and_bfloat16():
    lines = check_attention_backend(backend(), dtypes=("float32", "bfloat16"))
    assert lines and all(line.startswith("ok") for line in lines)


def test_matches_sdpa_with_sliding_window_soft_cap_and_other_shapes():
    grid = AttentionGrid(head_sizes=(32, 128), heads=((2, 1), (6, 3)), block_sizes=(8,),
                         sliding_windows=(None, 7), soft_caps=(None, 20.0))
    check_attention_backend(backend(), grid=grid)
