"""Qwen3-MoE and Mixtral end to end against HF transformers (float32, its eager experts loop):
tiny random checkpoints with more experts than active ones (and a dense layer in Qwen3-MoE),
8 prompts of mixed lengths submitted together, greedy ids equal under batching, prefix
caching, chunked prefill, preemption and async scheduling. On CUDA (``gpu``): float32 against
HF on the GPU, and CUDA-graph replay against eager in bfloat16.
"""

from __future__ import annotations

import random

import pytest
import torch
from conftest import assert_all_blocks_free
from moe_factory import MOE_ARCHS, make_moe_model, use_eager_experts
from reference import check_greedy_match, ember_top5, hf_greedy

from ember import LLM, SamplingParams

PROMPT_LENS = [1, 5, 11, 16, 17, 29, 40, 63]
MAX_NEW = 16


def _hf(path, device="cpu"):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
    use_eager_experts(model)
    return model


@pytest.fixture(scope="module", params=MOE_ARCHS)
def tiny(request, tmp_path_factory):
    path = make_moe_model(request.param, tmp_path_factory.mktemp(request.param))
    hf = _hf(path)
    rng = random.Random(1234)
    prompts = [[rng.randrange(3, hf.config.vocab_size) for _ in range(n)] for n in PROMPT_LENS]
    # Prompts 4-7 share prompt 7's first 12 tokens, so prefix caching has blocks to reuse.
    prompts[4:7] = [prompts[7][:12] + p for p in prompts[4:7]]
    refs = [hf_greedy(hf, p, MAX_NEW, {hf.config.eos_token_id}) for p in prompts]
    return request.param, str(path), prompts, refs


VARIANTS = {
    "batched_prefix_caching": dict(block_size=4),
    "chunked_prefill_tiny_kv_cache_preempts": dict(max_num_batched_tokens=16, block_size=4,
                                                   num_gpu_blocks_override=40),
    "async_tiny_kv_cache_preempts": dict(async_scheduling=True, block_size=4,
                                         num_gpu_blocks_override=40),
}


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_moe_greedy_matches_hf(tiny, variant):
    arch, path, prompts, refs = tiny
    llm = LLM(path, skip_tokenizer_init=True, max_model_len=128, **VARIANTS[variant])
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, logprobs=5)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert_all_blocks_free(llm)
    for i, (out, ref) in enumerate(zip(outputs, refs)):
        note = check_greedy_match(ref, out.outputs[0].token_ids, ember_top5(out.outputs[0]),
                                  f"{arch}/{variant}[{i}]")
        if note:
            print(note)
    stats = llm.llm_engine.stats()
    if "preempts" in variant:
        assert stats["num_preemptions"] > 0, "the small cache did not preempt"
    if variant == "batched_prefix_caching":
        assert sum(o.num_cached_tokens or 0 for o in outputs) > 0, "no prefix-cache hit"


@pytest.mark.gpu
def test_gpu_moe_float32_matches_hf(tiny):
    arch, path, prompts, _ = tiny
    hf = _hf(path, "cuda")
    refs = [hf_greedy(hf, p, MAX_NEW, {hf.config.eos_token_id}) for p in prompts]
    llm = LLM(path, skip_tokenizer_init=True, dtype="float32", max_model_len=128,
              kv_cache_memory_bytes=1 << 28)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=MAX_NEW, logprobs=5))
    for i, (out, ref) in enumerate(zip(outs, refs)):
        note = check_greedy_match(ref, out.outputs[0].token_ids, ember_top5(out.outputs[0]),
                                  f"{arch}/cuda[{i}]")
        if note:
            print(note)
    assert_all_blocks_free(llm)


@pytest.mark.gpu
def test_gpu_moe_graph_replay_equals_eager(tiny):
    """The fused MoE inside captured decode graphs (async scheduling on, CUDA's default) gives
    the eager engine's tokens."""
    import gc

    arch, path, prompts, _ = tiny
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    results = []
    for eager in (True, False):
        llm = LLM(path, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=128,
                  kv_cache_memory_bytes=1 << 28, enforce_eager=eager, max_num_seqs=16)
        if not eager:
            assert llm.llm_engine.executor.runner.graph_runner is not None
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        results.append([o.outputs[0].token_ids for o in outs])
        assert_all_blocks_free(llm)
        llm.shutdown()
        del llm
        gc.collect()
    assert results[0] == results[1]
