"""GPU (marked gpu; skipped without CUDA): Gemma 2, Gemma 3 and Phi-3 (LongRoPE, long regime) on
the CUDA backends. float32 greedy ids equal HF transformers (eager attention, on the GPU) with the
Triton backend (CUDA graphs on: soft-capped and windowed kernels inside captured graphs) and with
SDPA; in bfloat16, every other backend gives SDPA's tokens up to float near-ties.

Shapes are the real models' head sizes (Gemma 256, Phi-3 96 -> 128 here: Triton takes powers of
two) with a 32-token window, and prompts up to 200 tokens, so most keys of local layers are out of
the window.
"""

from __future__ import annotations

import importlib.util
import random

import pytest
import torch
from conftest import assert_all_blocks_free
from gemma_phi_factory import LONGROPE_ORIGINAL, make_model
from reference import check_greedy_match, ember_top5, hf_greedy

from ember import LLM, SamplingParams

pytestmark = pytest.mark.gpu
PROMPT_LENS = [1, 7, 16, 33, 64, 100, 130, 200]
LONG_PROMPT_LENS = [33, 40, 64, 77, 100, 130, 170, 200]  # all past LongRoPE's original 32
MAX_NEW = 24
SHAPES = {
    "gemma2": dict(head_dim=256, hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                   sliding_window=32, query_pre_attn_scalar=192, attn_logit_softcapping=20.0,
                   final_logit_softcapping=15.0, max_position_embeddings=512),
    "gemma3": dict(head_dim=256, hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                   sliding_window=32, query_pre_attn_scalar=192, max_position_embeddings=512),
    "phi3_longrope": dict(hidden_size=512, num_attention_heads=4, num_key_value_heads=2,
                          partial_rotary_factor=1.0, max_position_embeddings=512,
                          rope_scaling={"type": "longrope",
                                        "short_factor": [1.0 + 0.01 * i for i in range(64)],
                                        "long_factor": [1.0 + 0.2 * i for i in range(64)]}),
}


@pytest.fixture(autouse=True)
def _release_gpu_memory():
    import gc

    yield
    gc.collect()
    torch.cuda.empty_cache()


@pytest.fixture(scope="module", params=list(SHAPES))
def tiny(request, tmp_path_factory):
    path = make_model(request.param, tmp_path_factory.mktemp(request.param),
                      **SHAPES[request.param])
    lens = LONG_PROMPT_LENS if request.param == "phi3_longrope" else PROMPT_LENS
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 320) for _ in range(n)] for n in lens]
    return request.param, str(path), prompts


def _llm(path: str, **kw) -> LLM:
    return LLM(path, skip_tokenizer_init=True, max_model_len=512, kv_cache_memory_bytes=1 << 30,
               max_num_batched_tokens=256, **kw)


@pytest.mark.parametrize("backend", ["triton", "sdpa"])
def test_gpu_float32_greedy_matches_hf(tiny, backend):
    from transformers import AutoModelForCausalLM

    arch, path, prompts = tiny
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                              attn_implementation="eager").cuda().eval()
    assert arch != "phi3_longrope" or min(map(len, prompts)) > LONGROPE_ORIGINAL
    refs = [hf_greedy(hf, p, MAX_NEW, {hf.config.eos_token_id}) for p in prompts]
    del hf
    llm = _llm(path, dtype="float32", attention_backend=backend)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=MAX_NEW, logprobs=5))
    for i, (out, ref) in enumerate(zip(outs, refs)):
        note = check_greedy_match(ref, out.outputs[0].token_ids, ember_top5(out.outputs[0]),
                                  f"{arch}/{backend}[{i}]")
        if note:
            print(note)
    assert_all_blocks_free(llm)


def _bf16_backends() -> list[str]:
    names = ["triton"]
    if importlib.util.find_spec("flashinfer") is not None:
        names.append("flashinfer")
    return names


@pytest.mark.parametrize("backend", _bf16_backends())
def test_gpu_bf16_backend_equals_sdpa(tiny, backend):
    arch, path, prompts = tiny
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=5)
    outs = {}
    for name in ("sdpa", backend):
        llm = _llm(path, dtype="bfloat16", attention_backend=name)
        outs[name] = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        assert_all_blocks_free(llm)
        del llm
    # bf16 kernels round differently: every sequence agrees up to its first difference, and
    # there the backend's token was a near-tie in the SDPA run (in its top 5, within 0.1 nats).
    for a, b in zip(outs["sdpa"], outs[backend]):
        ids_a, ids_b = a.outputs[0].token_ids, b.outputs[0].token_ids
        if ids_a == ids_b:
            continue
        first = next(i for i, (x, y) in enumerate(zip(ids_a, ids_b)) if x != y)
        top = a.outputs[0].logprobs[first]
        assert ids_b[first] in top, (arch, first, ids_b[first], top)
        assert top[ids_a[first]].logprob - top[ids_b[first]].logprob < 0.1, (arch, first)
