"""EngineArgs.kv_cache_dtype: an fp8 KV cache through the engine, and its refusals.

On the CPU the "triton" backend runs under TRITON_INTERPRET=1. An fp8 cache must give exactly
what float attention over fp8-rounded keys and values gives: the reference run keeps a float32
cache and rounds K and V to float8_e4m3fn (torch's cast) before the backend sees them; prompt
logprobs and greedy tokens must agree, and the cache takes a quarter of the bytes per block.
The test prints the error fp8 rounding itself causes (fp8 against float32 KV). The ``gpu`` case
is a bf16 model with an fp8 cache against the bf16 cache, decode graphs included, and prints
its logit error. Backends without fp8 caches (sdpa, flashinfer) are refused by name, as are
fp8_e5m2 and pooling models (no KV cache).
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from model_factory import make_tiny_model  # noqa: E402

from ember import LLM, EngineArgs, SamplingParams  # noqa: E402
from ember.attention_backends.triton_backend import TritonImpl  # noqa: E402

PROMPTS = [[5, 17, 42, 99, 3, 250, 11, 8, 64, 31, 7], [200, 1, 77, 13, 90]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return str(make_tiny_model("llama", tmp_path_factory.mktemp("kvdtype")))


def _run(path: str, kv_cache_dtype: str, max_tokens: int = 3, **kw) -> tuple[list, list, int]:
    llm = LLM(path, skip_tokenizer_init=True, max_model_len=64, attention_backend="triton",
              kv_cache_dtype=kv_cache_dtype, num_gpu_blocks_override=32, **kw)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, prompt_logprobs=0,
                            logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    per_block = llm.collective_rpc("bytes_per_block")[0]
    llm.shutdown()
    prompt_lp = [[next(iter(d.values())).logprob for d in o.prompt_logprobs[1:]] for o in outs]
    tokens = [o.outputs[0].token_ids for o in outs]
    return prompt_lp, tokens, per_block


def _max_diff(a: list, b: list) -> float:
    return max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))


def _compare(path: str, dtype: str, max_tokens: int, monkeypatch) -> tuple[float, float]:
    """(error against attention over fp8-rounded K/V, error against the plain cache), in prompt
    logprobs. In float32 the greedy tokens must equal those of the rounded-K/V run (the same
    arithmetic); a 16-bit model's fp8 attention computes in float16 (widen_fp8_to_f16), finer
    than the reference's bfloat16, so a random model's near-tied tokens may part."""
    plain_lp, _, plain_bytes = _run(path, "auto", max_tokens, dtype=dtype)
    lp, tokens, fp8_bytes = _run(path, "fp8", max_tokens, dtype=dtype)
    assert fp8_bytes * (4 if dtype == "float32" else 2) == plain_bytes  # one byte per element
    forward = TritonImpl.forward

    def rounded_kv(self, query, key, value, kv_cache, metadata):
        fp8 = torch.float8_e4m3fn
        return forward(self, query, key.to(fp8).to(key.dtype), value.to(fp8).to(value.dtype),
                       kv_cache, metadata)

    with monkeypatch.context() as patch:
        patch.setattr(TritonImpl, "forward", rounded_kv)
        ref_lp, ref_tokens, _ = _run(path, "auto", max_tokens, dtype=dtype)
    if dtype == "float32":
        assert tokens == ref_tokens
    else:
        same = sum(a == b for t, r in zip(tokens, ref_tokens) for a, b in zip(t, r))
        print(f"greedy tokens equal to the rounded-K/V run's: {same} of "
              f"{sum(map(len, tokens))}")
        assert [t[0] for t in tokens] == [r[0] for r in ref_tokens]  # from the prompt alone
    return _max_diff(lp, ref_lp), _max_diff(lp, plain_lp)


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the gpu case below covers CUDA")
def test_fp8_kv_cache_equals_attention_over_rounded_kv(tmp_path, monkeypatch):
    path = str(make_tiny_model("llama", tmp_path, num_hidden_layers=1))
    exact, err = _compare(path, "float32", 3, monkeypatch)
    print(f"fp8 KV vs float32 KV (a random tiny model): max prompt-logprob error {err:.4f}")
    assert exact < 1e-5
    assert err > 0.0  # the cache really is fp8


def test_kv_cache_dtype_refusals(tiny):
    with pytest.raises(ValueError, match="kv_cache_dtype.*fp8_e5m2 is not supported"):
        EngineArgs(model=tiny, kv_cache_dtype="fp8_e5m2").validate()
    with pytest.raises(ValueError, match="sdpa.*kv_cache_dtype='fp8' not supported"):
        LLM(tiny, skip_tokenizer_init=True, attention_backend="sdpa", kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8': pooling models"):
        LLM(tiny, skip_tokenizer_init=True, runner="pooling", convert="embed",
            kv_cache_dtype="fp8")


@pytest.mark.gpu
def test_fp8_kv_cache_bf16_logit_error(tmp_path, monkeypatch):
    """A larger random Llama (head size 128, GQA) in bf16, decode steps in CUDA graphs: the
    fp8 cache against attention over fp8-rounded K/V (equal up to bf16 and float16 rounding)
    and against the bf16 cache (the error fp8 costs, printed)."""
    path = str(make_tiny_model("llama", tmp_path, hidden_size=512, intermediate_size=1024,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=128,
                               num_hidden_layers=4))
    exact, err = _compare(path, "bfloat16", 16, monkeypatch)
    print(f"fp8 KV vs bf16 KV (bf16 model): max prompt-logprob error {err:.4f} (against "
          f"rounded K/V: {exact:.2e})")
    # With the same bfloat16 arithmetic as the reference this was below 2e-2; computing in
    # float16 (widen_fp8_to_f16) the two part by 0.178 nats on an H200, still well inside the
    # error fp8 itself costs (0.498 there).
    assert exact < 0.25
    assert exact < err < 1.0
