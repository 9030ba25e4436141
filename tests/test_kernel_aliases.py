"""The old import paths of the kernels (ember.attention_backends.triton_ops.*,
ember.layers.fused_ops, the kernel names of ember.layers.linear) still import, warn that they
are deprecated, and hand out the objects of ember.kernels; ``import ember.kernels`` itself loads
neither torch nor triton."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys

import pytest
import torch

if not torch.cuda.is_available():
    # Must be set before a kernel module is imported: @triton.jit reads it then.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _fresh_import(name: str):
    """Import ``name`` anew (and its alias parents), as a plugin's first import would."""
    for loaded in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
        del sys.modules[loaded]
    parent = name.rpartition(".")[0]
    if parent.endswith("triton_ops"):
        sys.modules.pop(parent, None)
    return importlib.import_module(name)


def test_layers_fused_ops_alias_warns_and_resolves():
    with pytest.warns(DeprecationWarning, match="ember.kernels"):
        fused_ops = _fresh_import("ember.layers.fused_ops")
    from ember.kernels import launch
    from ember.layers.sampler import greedy_argmax

    assert fused_ops.pdl_options is launch.pdl_options
    assert fused_ops.greedy_argmax is greedy_argmax
    assert not fused_ops.fused_ops_enabled(torch.zeros(2, dtype=torch.bfloat16))  # CPU


@pytest.mark.parametrize("module,names", [
    ("ember.attention_backends.triton_ops",
     ["store_kv", "paged_decode_attention", "paged_prefill_attention", "DECODE_CONFIGS"]),
    ("ember.attention_backends.triton_ops.decode", ["default_config", "DecodeConfig"]),
    ("ember.attention_backends.triton_ops.prefill", ["PrefillConfig", "PREFILL_CONFIGS"]),
    ("ember.attention_backends.triton_ops.store_kv", ["store_kv"]),
    ("ember.attention_backends.triton_ops.common", ["num_sms", "head_pad", "scaled_scores"]),
])
def test_triton_ops_aliases_warn_and_resolve(module, names):
    pytest.importorskip("triton")
    with pytest.warns(DeprecationWarning, match="ember.kernels"):
        alias = _fresh_import(module)
    for name in names:
        assert getattr(alias, name) is not None
    from ember.kernels.store_kv import store_kv

    if hasattr(alias, "store_kv"):
        assert alias.store_kv is store_kv


def test_linear_kernel_names_warn_and_resolve():
    from ember.layers import linear

    with pytest.warns(DeprecationWarning, match="small_batch_linear"):
        old = linear.small_gemm_config
    from ember.kernels.small_batch_linear import small_batch_linear_config

    assert old is small_batch_linear_config


def test_import_ember_kernels_loads_neither_torch_nor_triton():
    code = ("import sys, ember.kernels, ember.kernels.tuning; "
            "print(sorted({'torch', 'triton'} & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
