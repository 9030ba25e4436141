"""GGUF kept quantized: block decoding equals the gguf package's dequantization for every
supported type (tensors written with the gguf package's writer and quantizers), the gguf
method's linear layers (fused, mixed types) against their dequantized weights through
ember.testing, the Triton dequantize-matmul under the interpreter, and the default model kept
quantized against the same model dequantized (greedy agreement over 8 prompts x 64 tokens)."""

from __future__ import annotations

import itertools
import os
import sys

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    # Before anything imports triton: an interpreted kernel cannot call triton's own jit
    # functions (tl.cdiv, ...) if triton was imported without the interpreter. The engines in
    # this file still run the CPU path (ember.quantization.gguf.INTERPRET_ON_CPU stays off).
    os.environ.setdefault("TRITON_INTERPRET", "1")

from gguf.constants import GGML_QUANT_SIZES  # noqa: E402
from gguf.quants import dequantize as gguf_dequantize  # noqa: E402

from ember.quantization.gguf_blocks import SUPPORTED, Q, decode_blocks, dequantize  # noqa: E402
from ember.testing import check_quantized_linear  # noqa: E402

_LEGACY = (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0)  # the gguf package quantizes these


def _blocks(qtype: Q, weight: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """uint8 [rows, row bytes] GGUF blocks for a float weight: the gguf package's quantizer for
    the legacy types; the K types (which it cannot quantize) get random codes and sub-block
    scales with sane float16 super-block scales."""
    from gguf.quants import quantize

    if qtype in _LEGACY:
        return np.ascontiguousarray(quantize(weight.astype(np.float32), qtype))
    n, k = weight.shape
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (n, k // block, size), dtype=np.uint8)
    d = (rng.random((n, k // block)) * 0.004 + 0.001).astype(np.float16)
    at = 208 if qtype == Q.Q6_K else 0
    raw[:, :, at:at + 2] = d.view(np.uint8).reshape(n, k // block, 2)
    if qtype != Q.Q6_K:
        dmin = (rng.random((n, k // block)) * 0.004).astype(np.float16)
        raw[:, :, 2:4] = dmin.view(np.uint8).reshape(n, k // block, 2)
    return raw.reshape(n, -1)


def test_block_decoding_equals_the_gguf_package(tmp_path):
    """Every type, written to a .gguf file by GGUFWriter and read back by ember's loader."""
    from gguf import GGUFWriter

    from ember.models.loader.gguf import _raw_blocks, read_gguf_header

    rng = np.random.default_rng(0)
    path = str(tmp_path / "types.gguf")
    writer = GGUFWriter(path, "llama")
    shapes = {}
    for i, qtype in enumerate(SUPPORTED):
        weight = rng.standard_normal((6 + i, 512)).astype(np.float32) * 0.05
        weight[2] = 0.0  # an all-zero row
        writer.add_tensor(f"t.{qtype.name}", _blocks(qtype, weight, rng), raw_dtype=qtype)
        shapes[qtype] = weight.shape
    writer.write_header_to_file(), writer.write_kv_data_to_file()
    writer.write_tensors_to_file(), writer.close()
    header = read_gguf_header(path)
    with open(path, "rb") as f:
        for qtype in SUPPORTED:
            info = header.tensors[f"t.{qtype.name}"]
            assert info.qtype == qtype and info.shape == shapes[qtype]
            raw = _raw_blocks(path, f, info)
            want = gguf_dequantize(raw, qtype).reshape(info.shape)
            got = dequantize(torch.from_numpy(raw.copy()), qtype, info.shape)
            assert np.array_equal(got.numpy(), want), qtype.name  # bit for bit
    with pytest.raises(NotImplementedError, match="Q2_K is not supported"):
        decode_blocks(torch.zeros(1, 84, dtype=torch.uint8), Q.Q2_K, (1, 256))


def _gguf_tensors(types):
    """make_tensors for ember.testing.check_quantized_linear: shard i gets types[i % len]."""
    rng = np.random.default_rng(1)
    cycle = itertools.cycle(types)

    def make(weight: torch.Tensor):
        qtype = next(cycle)
        raw = torch.from_numpy(_blocks(qtype, weight.numpy(), rng))
        raw.gguf_qtype, raw.gguf_shape = qtype, tuple(weight.shape)
        return {"weight": raw}, dequantize(raw, qtype, tuple(weight.shape))

    return make


@pytest.mark.parametrize("types", [(q,) for q in SUPPORTED] + [(Q.Q4_K, Q.Q6_K), (Q.Q4_1, Q.Q8_0)],
                         ids=lambda t: "+".join(q.name for q in t))
def test_gguf_linear_against_dequantized(types):
    """Fused two-shard layers (mixed types where two are given) through the conformance kit:
    int4 types take torch's int4 matmul up to 128 rows and a dequantized bfloat16 matmul above
    (bfloat16 inside, hence the bound), the others the per-call dequantization."""
    lines = check_quantized_linear("gguf", _gguf_tensors(types), dtypes=("float32", "bfloat16"),
                                   shapes=(([64, 32], 256), ([96, 64], 512)), atol=2e-2,
                                   batch_sizes=(1, 7, 33, 130))
    assert len(lines) == 4


def test_triton_kernel_under_the_interpreter(monkeypatch):
    """The GPU kernel, interpreted on the CPU at small shapes, for a 4-bit and an 8-bit type
    and a mixed fused layer (the gguf method takes the Triton path under the interpreter)."""
    if "ember.kernels.gguf_matmul" in sys.modules and not torch.cuda.is_available():
        pytest.skip("the kernel module was defined without the interpreter in this process")
    from ember.quantization import gguf as gguf_method

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(gguf_method, "INTERPRET_ON_CPU", True)
    for types in [(Q.Q4_K,), (Q.Q6_K,), (Q.Q4_0, Q.Q5_1)]:
        lines = check_quantized_linear("gguf", _gguf_tensors(types), batch_sizes=(1, 20),
                                       shapes=(([32, 16], 256),), atol=1e-4)
        assert len(lines) == 1


QUESTIONS = [
    "What is the capital of France?", "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.", "List three primary colors.",
    "What is 12 times 7?", "Give me a tip for learning to cook.",
    "Translate 'good morning' into Spanish.", "Why is the sky blue?",
]  # fmt: skip


def _top1(position: dict) -> int:
    return next(tok for tok, lp in position.items() if lp.rank == 1)


@pytest.mark.slow
def test_default_model_kept_quantized_agrees_with_dequantized(caplog):
    """The default model computed from its Q4_1 blocks against the same model dequantized to
    float32, over 8 chat prompts x 64 greedy tokens of the float model: at each position, given
    the same prefix (the float model's tokens, fed as the prompt), the quantized model's greedy
    token equals the float model's on >= 90% of positions (502/512 measured). Free-running, the
    two generations part at the first near-tie (283/512 positions equal when measured), which
    says little about the kernel, so the test does not generate them (CI time)."""
    from ember import LLM, SamplingParams
    from ember.quantization import gguf as gguf_method
    from ember.quantization.gguf import GGUFLinearMethod

    greedy = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    ref_llm = LLM(quantization="none")
    tok = ref_llm.get_tokenizer()
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}],
                                       add_generation_prompt=True, tokenize=True,
                                       return_dict=False) for q in QUESTIONS]  # fmt: skip
    want = [o.outputs[0].token_ids for o in
            ref_llm.generate([{"prompt_token_ids": p} for p in prompts], greedy)]
    del ref_llm
    with caplog.at_level("INFO", logger="ember"):
        quant = LLM()
    assert "model weights take" in caplog.text and "gguf, 120 linear layers" in caplog.text
    model = quant.llm_engine.executor.runner.model
    layers = [m for m in model.modules() if isinstance(getattr(m, "quant_method", None),
                                                        GGUFLinearMethod)]
    # ember's native kernel where the CPU has AVX512-BF16, else torch's int4 matmul
    kind = "native" if gguf_method._native_kernel() else "int4_cpu"
    assert len(layers) == 120 and all(p.kind == kind for m in layers for p in m.gguf_parts)
    forced = quant.generate(
        [{"prompt_token_ids": list(p) + list(w)} for p, w in zip(prompts, want)],
        SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1))
    total = sum(len(w) for w in want)
    # prompt_logprobs[i]: the distribution over token i given the tokens before it.
    agree = sum(_top1(out.prompt_logprobs[len(p) + j]) == tok_id
                for out, p, w in zip(forced, prompts, want) for j, tok_id in enumerate(w))
    print(f"greedy agreement, quantized vs dequantized, same prefix: {agree}/{total} = "
          f"{agree / total:.4f}")
    assert agree / total >= 0.9

