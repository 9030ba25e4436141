"""AWQ and GPTQ checkpoints: linear layers through ember.testing's check, whole models against
HF transformers, and the refusals.

Checkpoints are made here (ember.testing.quantized_checkpoints): a tiny random Llama's
projections packed into AWQ's "gemm" layout or GPTQ's (v1 and v2 zeros, desc_act), next to the
float32 checkpoint of the dequantized weights. Greedy tokens of ember on the packed checkpoint
must equal HF transformers float32 on the dequantized one. On the CPU the layers compute in
torch; the ``gpu`` cases run the CUDA path (int4_gemv for 1-2 rows, int4_mma on the tensor
cores for 3-64 half-precision rows, int4_dequant + cuBLAS above) in the same checks.
"""

from __future__ import annotations

import json
import os
import shutil
from functools import partial

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # for the kernel-path case below

from model_factory import make_tiny_model  # noqa: E402

from ember import LLM, SamplingParams  # noqa: E402
from ember.quantization import int4_linear  # noqa: E402
from ember.quantization.awq import AWQQuantization  # noqa: E402
from ember.quantization.gptq import GPTQQuantization  # noqa: E402
from ember.testing import check_quantized_linear  # noqa: E402
from ember.testing.quantized_checkpoints import (  # noqa: E402
    awq_tensors,
    gptq_tensors,
    write_quantized_checkpoint,
)

PROMPTS = [[5, 17, 42, 99, 3, 250, 11], [200, 1, 77, 13]]
SHAPES = (([64, 32], 128), ([96, 64], 256))  # (shard sizes, in): fused layers


@pytest.mark.parametrize("name,make,config", [
    ("awq", partial(awq_tensors, group_size=64), {"group_size": 64}),
    ("gptq", partial(gptq_tensors, group_size=64), {"group_size": 64}),
    ("gptq", partial(gptq_tensors, group_size=32, desc_act=True, seed=3),
     {"group_size": 32, "desc_act": True}),
    ("gptq", partial(gptq_tensors, group_size=-1, sym=False, checkpoint_format="gptq_v2"),
     {"group_size": -1, "sym": False, "checkpoint_format": "gptq_v2"}),
], ids=["awq", "gptq", "gptq-desc_act", "gptq_v2-per-channel"])
def test_linear_layers_equal_their_dequantized_weights(name, make, config):
    lines = check_quantized_linear(name, make, config=config, shapes=SHAPES)
    assert len(lines) == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="the gpu case below covers CUDA")
@pytest.mark.parametrize("name,make,config", [
    ("awq", partial(awq_tensors, group_size=32), {"group_size": 32}),
    ("gptq", partial(gptq_tensors, group_size=32, desc_act=True, seed=5),
     {"group_size": 32, "desc_act": True}),
], ids=["awq", "gptq-desc_act"])
def test_layers_through_the_kernels_on_the_interpreter(name, make, config, monkeypatch):
    """The CUDA dispatch (input permutation, int4_gemv for one row, the weight dequantized by
    int4_dequant and F.linear above) with the kernels run by the Triton interpreter."""
    pytest.importorskip("triton")
    monkeypatch.setattr(int4_linear, "_kernels_take", lambda x: True)
    check_quantized_linear(name, make, config=config, shapes=(([32, 16], 64),),
                           batch_sizes=(1, 3, 20), dtypes=("float16",))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the gpu case below covers CUDA")
def test_half_rows_take_the_tensor_core_kernel_on_the_interpreter(monkeypatch):
    """Half-precision rows with whole 128-row tiles a group: int4_gemv for 1-2 rows, int4_mma
    for 3-64 (16 and then 32 rows a program), the dequantized weight above; each launched."""
    pytest.importorskip("triton")
    from ember import kernels

    monkeypatch.setattr(int4_linear, "_kernels_take", lambda x: True)
    launched = []

    def spy(fn, name):
        def call(*args, **kwargs):
            launched.append(name)
            return fn(*args, **kwargs)
        return call

    for module, name in ((kernels.int4_gemv, "int4_gemv"), (kernels.int4_mma, "int4_mma"),
                         (kernels.int4_dequant, "int4_dequantize")):
        monkeypatch.setattr(module, name, spy(getattr(module, name), name))
    check_quantized_linear("awq", partial(awq_tensors, group_size=128),
                           config={"group_size": 128}, shapes=(([64, 32], 256),),
                           batch_sizes=(2, 3, 40, 65), dtypes=("bfloat16", "float16"))
    assert set(launched) == {"int4_gemv", "int4_mma", "int4_dequantize"}, launched


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return str(make_tiny_model("llama", tmp_path_factory.mktemp("int4"), hidden_size=128,
                               intermediate_size=256, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=32))


def _hf_greedy(path: str, max_tokens: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = []
    for p in PROMPTS:
        seq = model.generate(torch.tensor([p]), max_new_tokens=max_tokens, do_sample=False)
        out.append(seq[0, len(p):].tolist())
    return out


@pytest.mark.slow
@pytest.mark.parametrize("method,opts", [
    ("awq", {"group_size": 64}),
    ("gptq", {"group_size": 64, "desc_act": True}),
], ids=["awq", "gptq-desc_act"])
def test_greedy_equals_transformers_on_dequantized_weights(tiny, tmp_path, method, opts):
    write_quantized_checkpoint(tiny, str(tmp_path / "q"), method, str(tmp_path / "deq"), **opts)
    ref = _hf_greedy(str(tmp_path / "deq"), 10)
    # float32 everywhere: on CUDA the int4 kernels then run in float32 against the same HF run.
    llm = LLM(str(tmp_path / "q"), skip_tokenizer_init=True, max_model_len=64, dtype="float32")
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(temperature=0.0, max_tokens=10))
    model = llm.llm_engine.executor.runner.model
    qkv = model.model.layers[0].self_attn.qkv_proj
    # Both formats end in ember's column-major form: 8 input rows per int32.
    assert qkv.qweight.dtype == torch.int32 and qkv.qweight.shape == (256, 128 // 8)
    assert (getattr(qkv, "perm", None) is not None) == opts.get("desc_act", False)
    llm.shutdown()
    assert [o.outputs[0].token_ids for o in outs] == ref


@pytest.mark.parametrize("cls,config,match", [
    (AWQQuantization, {"bits": 8}, "AWQ with bits=8"),
    (AWQQuantization, {"version": "gemv_fast"}, "AWQ version 'gemv_fast'"),
    (AWQQuantization, {"zero_point": False}, "zero_point=false"),
    (GPTQQuantization, {"bits": 3}, "GPTQ with bits=3"),
    (GPTQQuantization, {"checkpoint_format": "marlin"}, "checkpoint_format 'marlin'"),
    (GPTQQuantization, {"lm_head": True}, "quantized lm_head"),
    (GPTQQuantization, {"dynamic": {"-:.*mlp.*": {}}}, "'dynamic' overrides"),
])
def test_unsupported_variants_are_refused_by_name(cls, config, match):
    with pytest.raises(ValueError, match=match):
        cls.from_config(config)


def test_refusals_through_the_engine(tiny, tmp_path):
    target = tmp_path / "awq8"
    shutil.copytree(tiny, target)
    cfg = json.loads((target / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "awq", "bits": 8, "group_size": 64}
    (target / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="AWQ with bits=8"):
        LLM(str(target), skip_tokenizer_init=True, max_model_len=64)
    cfg["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 48}
    (target / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="group_size 48 does not divide"):
        LLM(str(target), skip_tokenizer_init=True, max_model_len=64)
    with pytest.raises(ValueError, match="quantization='awq' loads awq checkpoints, but .* float"):
        LLM(tiny, skip_tokenizer_init=True, max_model_len=64, quantization="awq")


def test_layers_named_in_modules_to_not_convert_stay_float():
    method = AWQQuantization.from_config({"modules_to_not_convert": ["mlp"]})
    assert method.get_linear_method(None, "model.layers.0.mlp.down_proj") is None
    assert method.get_linear_method(None, "model.layers.0.self_attn.o_proj") is not None


@pytest.mark.gpu
@pytest.mark.parametrize("name,make,config", [
    ("awq", partial(awq_tensors, group_size=128), {"group_size": 128}),
    ("gptq", partial(gptq_tensors, group_size=128, desc_act=True, seed=1),
     {"group_size": 128, "desc_act": True}),
])
def test_linear_layers_on_cuda_take_the_kernels(name, make, config):
    """Decode and prefill batch sizes (int4_gemv for 1-2 rows, int4_mma for 3-64,
    dequantized + cuBLAS above) in half precision, at a Llama-8B-like fused shape."""
    lines = check_quantized_linear(name, make, config=config, device="cuda",
                                   shapes=(([1024, 512], 4096),),
                                   batch_sizes=(1, 2, 4, 16, 17, 64, 65, 300),
                                   dtypes=("float16", "bfloat16"))
    print("\n".join(lines))
