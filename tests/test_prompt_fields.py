"""Prompt dict fields and truncate_prompt_tokens through LLM, LLMEngine (engine core in this
process and in its own) and AsyncLLM.

- multi_modal_data, mm_processor_kwargs, multi_modal_uuids, token_type_ids, prompt_embeds and
  unknown keys are refused with a ValueError naming them, and leave nothing queued.
- cache_salt: requests share prefix-cache blocks only with requests of the same salt (the
  per-request hit counter, num_cached_tokens, shows it), and the salt never changes the tokens.
- truncate_prompt_tokens keeps the prompt's last k tokens: the result equals a second request
  given those k tokens directly.
"""

from __future__ import annotations

import asyncio

import pytest
from conftest import assert_all_blocks_free, assert_all_blocks_free_async
from text_model import PROMPT, collect_async, make_text_model, run_engine, text_args

from ember import SamplingParams
from ember.engine.async_llm import AsyncLLM
from ember.engine.llm_engine import LLMEngine
from ember.sampling_params import RequestOutputKind

GREEDY = dict(temperature=0.0, max_tokens=6, ignore_eos=True,
              output_kind=RequestOutputKind.FINAL_ONLY)
REFUSED = {
    "multi_modal_data": {"image": "notanimage"},
    "mm_processor_kwargs": {"num_crops": 4},
    "multi_modal_uuids": {"image": ["u"]},
    "token_type_ids": [0, 0, 0],
    "prompt_embeds": [[0.0]],
}


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return make_text_model(tmp_path_factory.mktemp("fields"))


@pytest.fixture(scope="module", params=[False, True], ids=["in_process", "core_process"])
def engine(model_path, request):
    engine = LLMEngine(text_args(model_path), multiprocess=request.param)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def async_engine(model_path):
    engine = AsyncLLM(text_args(model_path))
    yield engine
    engine.shutdown_sync()


def _bad_prompts():
    for key, value in REFUSED.items():
        yield key, {"prompt": PROMPT, key: value}
        yield key, {"prompt_token_ids": [5, 6, 7], key: value}
    yield "colour", {"prompt": PROMPT, "colour": "red"}
    yield "cache_salt", {"prompt": PROMPT, "cache_salt": 42}


def test_refused_prompt_fields(engine, async_engine):
    for key, prompt in _bad_prompts():
        with pytest.raises(ValueError, match=key):
            engine.add_request(f"bad-{key}", prompt, SamplingParams(**GREEDY))
        with pytest.raises(ValueError, match=key):
            collect_async(async_engine, prompt, SamplingParams(**GREEDY), f"bad-{key}")
    # None means absent (vLLM's TypedDicts allow it).
    [out] = run_engine(engine, [("none-mm", {"prompt": PROMPT, "multi_modal_data": None},
                                 SamplingParams(**GREEDY))])
    assert len(out.outputs[0].token_ids) == 6
    assert_all_blocks_free(engine)
    asyncio.run(assert_all_blocks_free_async(async_engine))


def _salted(salt: str | None) -> dict:
    prompt: dict = {"prompt": "(salt test) " + PROMPT}
    if salt is not None:
        prompt["cache_salt"] = salt
    return prompt


SALT_RUNS = [  # (salt, whether its prompt blocks are in the cache by then)
    (None, False), (None, True), ("alice", False), ("alice", True), ("bob", False),
    (None, True), ("bob", True),
]


def test_cache_salt_separates_prefix_cache(engine):
    results = []
    for i, (salt, _) in enumerate(SALT_RUNS):  # one at a time: each sees the last one's blocks
        [out] = run_engine(engine, [(f"salt-{i}", _salted(salt), SamplingParams(**GREEDY))])
        results.append(out)
    num_prompt = len(results[0].prompt_token_ids)
    assert num_prompt >= 32  # two full blocks of 16
    for (salt, cached), out in zip(SALT_RUNS, results):
        assert (out.num_cached_tokens > 0) == cached, (salt, out.num_cached_tokens)
        assert out.outputs[0].token_ids == results[0].outputs[0].token_ids  # never the tokens
    assert_all_blocks_free(engine)


def test_async_cache_salt(async_engine):
    hits = []
    for i, (salt, _) in enumerate(SALT_RUNS):
        out = collect_async(async_engine, _salted(salt), SamplingParams(**GREEDY), f"as-{i}")[-1]
        hits.append(out.num_cached_tokens > 0)
    assert hits == [cached for _, cached in SALT_RUNS]


def test_truncate_prompt_tokens(engine):
    ids = engine.get_tokenizer().encode(PROMPT)
    assert len(ids) > 12
    runs = [
        ("text", PROMPT, dict(truncate_prompt_tokens=12)),
        ("tokens", {"prompt_token_ids": ids}, dict(truncate_prompt_tokens=12)),
        ("direct", {"prompt_token_ids": ids[-12:]}, {}),
        ("all", PROMPT, dict(truncate_prompt_tokens=-1)),  # max_model_len: nothing to cut here
        ("whole", {"prompt_token_ids": ids}, {}),
    ]
    outs = {}
    for name, prompt, extra in runs:
        [outs[name]] = run_engine(engine, [(f"trunc-{name}", prompt,
                                            SamplingParams(**GREEDY, **extra))])
    for name in ("text", "tokens", "direct"):
        assert outs[name].prompt_token_ids == ids[-12:]
        assert outs[name].outputs[0].token_ids == outs["direct"].outputs[0].token_ids
    assert outs["all"].prompt_token_ids == ids
    assert outs["all"].outputs[0].token_ids == outs["whole"].outputs[0].token_ids
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        engine.add_request("trunc-big", PROMPT, SamplingParams(truncate_prompt_tokens=10_000))
    for bad in (0, -2, 1.5):
        with pytest.raises(ValueError, match="truncate_prompt_tokens"):
            SamplingParams(truncate_prompt_tokens=bad)
    assert_all_blocks_free(engine)


def test_async_truncate_prompt_tokens(async_engine):
    ids = async_engine.tokenizer.encode(PROMPT)
    cut = collect_async(async_engine, PROMPT, SamplingParams(**GREEDY, truncate_prompt_tokens=9),
                        "at-cut")[-1]
    direct = collect_async(async_engine, {"prompt_token_ids": ids[-9:]}, SamplingParams(**GREEDY),
                           "at-direct")[-1]
    assert cut.prompt_token_ids == ids[-9:]
    assert cut.outputs[0].token_ids == direct.outputs[0].token_ids
