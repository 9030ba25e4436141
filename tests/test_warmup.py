"""Start-up warm-up and profile: the plan stays within the engine's limits, the build runs it and
reports it in ``startup_breakdown``, and it changes nothing: the KV caches are all zeros again,
and the engine gives the same tokens (greedy with logprobs, prompt logprobs, seeded and unseeded
random) as one built without it, with every KV block free afterwards."""

from __future__ import annotations

import pytest
from conftest import assert_all_blocks_free
from model_factory import make_tiny_model

from ember import LLM, SamplingParams
from ember.worker import warmup
from ember.worker.startup_profile import StartupProfile, format_breakdown

ENGINE = dict(max_model_len=256, max_num_seqs=32, max_num_batched_tokens=512)


@pytest.mark.parametrize("full", [True, False])
@pytest.mark.parametrize("max_tokens,max_num_seqs,max_model_len",
                         [(8192, 256, 40960), (512, 32, 256), (16, 4, 64), (2, 1, 2)])
def test_plan_fits_the_engine_limits(full, max_tokens, max_num_seqs, max_model_len):
    plan = warmup.warmup_plan(max_tokens, max_num_seqs, max_model_len, full)
    assert plan
    for step in plan:
        assert 1 <= len(step) <= max_num_seqs
        assert sum(r.num_scheduled for r in step) <= max_tokens
        for r in step:
            assert 1 <= r.num_scheduled <= r.num_tokens <= max_model_len


def test_full_plan_covers_the_shapes():
    plan = warmup.warmup_plan(8192, 256, 40960, full=True)
    assert sum(r.num_scheduled for r in plan[0]) == 8192  # the largest prefill
    prefill_chunks = {step[0].num_scheduled for step in plan if len(step) == 1}
    assert {2, 4, 8, 16, 32, 64, 128, 256} <= prefill_chunks
    decode_batches = {len(step) for step in plan if all(r.num_scheduled == 1 for r in step)}
    assert {1, 2, 16, 128, 256} <= decode_batches
    mixed = [step for step in plan if len({r.num_scheduled for r in step}) > 1]
    assert {len(step) - 1 for step in mixed} == set(warmup.MIXED_DECODE_COUNTS)
    assert {step[-1].num_tokens for step in mixed} >= {64, 96, 4096, 40960}


def test_host_plan_ends_with_a_one_token_step():
    """On the host: one mixed step, then one of a single token, which torch.compile traces
    apart (dynamo specializes sizes 0 and 1), so compile_model compiles both in start-up."""
    plan = warmup.warmup_plan(512, 32, 256, full=False)
    assert len(plan) == 2 and len({r.num_scheduled for r in plan[0]}) > 1
    assert [r.num_scheduled for r in plan[1]] == [1]


def test_startup_profile_adds_up_stages():
    profile = StartupProfile()
    with profile.stage("weights"):
        pass
    with profile.stage("weights"):
        pass
    breakdown = profile.breakdown()
    assert list(breakdown) == ["weights", "total"]
    assert breakdown["total"] >= breakdown["weights"] >= 0
    assert format_breakdown(breakdown).endswith("(weights 0.00)")


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory):
    return str(make_tiny_model("qwen3", tmp_path_factory.mktemp("qwen3")))


def _outputs(llm: LLM) -> list:
    prompts = [{"prompt_token_ids": [3 + (7 * i + j) % 50 for j in range(n)]}
               for i, n in enumerate([1, 5, 17, 40])]
    params = [SamplingParams(temperature=0.0, max_tokens=8, logprobs=3),
              SamplingParams(temperature=0.9, top_p=0.9, max_tokens=8, seed=7),
              SamplingParams(temperature=1.0, max_tokens=8),
              SamplingParams(temperature=0.0, max_tokens=8, prompt_logprobs=2)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert_all_blocks_free(llm)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs, o.prompt_logprobs) for o in outs]


def _build(model: str, monkeypatch, run_warmup) -> tuple[LLM, dict]:
    monkeypatch.delenv("EMBER_ENGINE_PROCESS", raising=False)  # the executor in this process
    monkeypatch.setattr(warmup, "run_warmup", run_warmup)
    llm = LLM(model, **ENGINE)
    executor = llm.llm_engine.executor
    # Every block the dummy requests wrote is zero again: the cache is as allocated.
    assert all(not cache.any() for cache in executor.runner.kv_caches)
    return llm, executor.startup_breakdown


@pytest.mark.parametrize("full", [False, True])
def test_warmup_changes_no_result(tiny_qwen3, monkeypatch, full):
    steps: list[int] = []

    def counted(*args, **kwargs):
        steps.append(warmup_run(*args, **kwargs, full=full))
        return steps[-1]

    warmup_run = warmup.run_warmup
    warm, breakdown = _build(tiny_qwen3, monkeypatch, counted)
    assert steps and steps[0] > 0
    assert {"weights", "kv_cache", "warmup", "total"} <= set(breakdown)
    assert breakdown["total"] >= breakdown["warmup"] > 0
    warm_out = _outputs(warm)
    warm.shutdown()
    cold, _ = _build(tiny_qwen3, monkeypatch, lambda *args, **kwargs: 0)
    cold_out = _outputs(cold)
    cold.shutdown()
    assert warm_out == cold_out
