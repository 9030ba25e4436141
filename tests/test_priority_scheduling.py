"""Priority scheduling (EngineArgs.scheduling_policy="priority", vLLM's semantics).

Scheduler unit tests: the waiting queue is ordered by (priority, arrival), lower first; when
blocks run out the lowest-ranked running request is preempted (not the newest, as under fcfs);
a waiting request that finds no blocks preempts running requests ranked below it, and only those.
Engine runs (LLM; LLMEngine with its core in this process, also with async scheduling, and in
its own; AsyncLLM): requests are first scheduled in priority order, a high-priority arrival
preempts a low-priority request that holds the KV cache, and greedy tokens equal an fcfs run
(priority changes order, never results). Under fcfs a non-zero priority is a ValueError.
"""

from __future__ import annotations

import pytest
from conftest import assert_all_blocks_free
from text_model import PROMPT, collect_async, make_text_model, run_engine, text_args

from ember import LLM, SamplingParams
from ember.core.kv_cache_manager import KVCacheManager
from ember.core.request import Request
from ember.core.scheduler import Scheduler
from ember.core.scheduler_output import ModelRunnerOutput
from ember.engine.async_llm import AsyncLLM
from ember.engine.llm_engine import LLMEngine
from ember.sampling_params import RequestOutputKind

BS = 4


def make(num_blocks=64, budget=64, max_seqs=8, policy="priority"):
    return Scheduler(KVCacheManager(num_blocks, BS, True), budget, max_seqs, max_model_len=256,
                     policy=policy)


def add(sched, rid, n_prompt, priority=0, max_tokens=4, arrival=None):
    start = 10 + 100 * len(sched.requests)  # distinct prompts: no prefix-cache hits
    req = Request(rid, [start + i for i in range(n_prompt)], SamplingParams(max_tokens=max_tokens),
                  {0}, BS, arrival_time=arrival, priority=priority)
    sched.add_request(req)
    return req


def fake_step(sched):
    out = sched.schedule()
    result = ModelRunnerOutput()
    for rid in out.num_scheduled_tokens:
        req = sched.requests[rid]
        if req.num_computed_tokens == req.num_tokens:
            result.sampled_token_ids[rid] = 7
    sched.update_from_output(out, result)
    return out


def test_waiting_order_is_priority_then_arrival():
    sched = make(max_seqs=1)
    for rid, prio, arrival in [("late-1", 1, 3.0), ("p3", 3, 1.0), ("early-1", 1, 2.0),
                               ("p0", 0, 4.0)]:
        add(sched, rid, 3, priority=prio, max_tokens=1, arrival=arrival)
    order = []
    while sched.has_unfinished_requests():
        order += list(fake_step(sched).num_scheduled_tokens)
    assert order == ["p0", "early-1", "late-1", "p3"]


def test_fcfs_ignores_priority_order():
    sched = make(max_seqs=1, policy="fcfs")
    for rid, prio in [("a", 3), ("b", 0)]:
        add(sched, rid, 3, priority=prio, max_tokens=1)
    order = []
    while sched.has_unfinished_requests():
        order += list(fake_step(sched).num_scheduled_tokens)
    assert order == ["a", "b"]


@pytest.mark.parametrize("policy,victim", [("priority", "low"), ("fcfs", "high")])
def test_out_of_blocks_preempts_lowest_ranked(policy, victim):
    # Two requests of 2 blocks' prompt each fill 4 of 5 blocks; growing needs a sixth.
    sched = make(num_blocks=5, policy=policy)
    add(sched, "low", 8, priority=5, max_tokens=8, arrival=1.0)
    add(sched, "high", 8, priority=0, max_tokens=8, arrival=2.0)  # newer, but ranked first
    preempted = set()
    for _ in range(12):
        preempted |= fake_step(sched).preempted_req_ids
        if preempted:
            break
    assert preempted == {victim}


def test_waiting_high_priority_preempts_running_low():
    sched = make(num_blocks=6)
    low = add(sched, "low", 16, priority=5, max_tokens=8)  # 5 blocks of 6 while decoding
    fake_step(sched)
    high = add(sched, "high", 8, priority=0, max_tokens=2)  # needs 2 blocks: only 1 free
    out = fake_step(sched)
    assert out.preempted_req_ids == {"low"}
    assert "high" in out.num_scheduled_tokens and high in sched.running and low in sched.waiting
    while sched.has_unfinished_requests():
        fake_step(sched)
    assert low.num_output_tokens == 8 and low.metrics.num_preemptions == 1


def test_waiting_low_priority_never_preempts():
    for policy, prio in [("priority", 9), ("priority", 5), ("fcfs", 0)]:
        sched = make(num_blocks=6, policy=policy)
        add(sched, "running", 16, priority=5, max_tokens=8)
        fake_step(sched)
        add(sched, "waiting", 8, priority=prio, max_tokens=2)  # equal rank: arrived later
        out = fake_step(sched)
        assert not out.preempted_req_ids and "waiting" not in out.num_scheduled_tokens


# ---- through the engines -------------------------------------------------------------------

@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return make_text_model(tmp_path_factory.mktemp("prio"))


def _params(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                          output_kind=RequestOutputKind.FINAL_ONLY)


def test_llm_priority_order_and_fcfs_refusal(model_path):
    prompts = [PROMPT, "Once upon a time", "A list of prime numbers:"]
    fcfs = LLM(model_path, **_small(max_num_seqs=1))
    reference = fcfs.generate(prompts, _params(5))
    with pytest.raises(ValueError, match="priority"):
        fcfs.generate(prompts, _params(5), priority=[0, 1, 0])
    with pytest.raises(ValueError, match="priority"):
        fcfs.llm_engine.add_request("x", PROMPT, _params(5), priority=2)
    assert_all_blocks_free(fcfs)
    fcfs.shutdown()
    llm = LLM(model_path, scheduling_policy="priority", **_small(max_num_seqs=1))
    outs = llm.generate(prompts, _params(5), priority=[2, 0, 1])
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in reference]
    first_scheduled = [o.metrics.first_scheduled_time for o in outs]
    assert sorted(range(3), key=first_scheduled.__getitem__) == [1, 2, 0]
    with pytest.raises(ValueError, match="priorities"):
        llm.generate(prompts, _params(5), priority=[0])
    assert_all_blocks_free(llm)
    llm.shutdown()


def _small(**kw) -> dict:
    """Engine args of text_args, with a KV cache of 8 blocks of 16 tokens (128 tokens)."""
    args = dict(tokenizer=text_args("x").tokenizer, max_model_len=128, block_size=16,
                num_gpu_blocks_override=8)
    args.update(kw)
    return args


def _preemption_run(engine, priorities: tuple[int, int]) -> dict:
    """A long low-priority request holds 7 of the 8 blocks and decodes; then a request that
    needs 3 blocks arrives. Returns the final outputs by request id."""
    tok = engine.get_tokenizer()
    long_ids = (tok.encode(PROMPT) * 4)[:100]
    short_ids = (tok.encode("Once upon a time there was a small village by the sea. ") * 8)[:40]
    low_params = SamplingParams(temperature=0.0, max_tokens=28, ignore_eos=True)  # cumulative
    engine.add_request("low", {"prompt_token_ids": long_ids}, low_params, priority=priorities[0])
    finished = []
    while not finished:  # until low is decoding (it holds its blocks now)
        outs = engine.step()
        finished += [o for o in outs if o.finished]
        if any(o.outputs[0].token_ids for o in outs):
            break
    assert not finished, "low finished before the second request arrived"
    outs = run_engine(engine, [("high", {"prompt_token_ids": short_ids}, _params(4))],
                      priority=priorities[1])
    finished += [o for o in outs if o.finished]
    assert_all_blocks_free(engine)
    return {o.request_id: o for o in finished}


@pytest.mark.parametrize("multiprocess,async_scheduling", [(False, False), (True, False),
                                                           (False, True)],
                         ids=["in_process", "core_process", "async_scheduling"])
def test_high_priority_arrival_preempts(model_path, multiprocess, async_scheduling):
    small = _small(async_scheduling=async_scheduling)
    engine = LLMEngine(text_args(model_path, scheduling_policy="priority", **small),
                       multiprocess=multiprocess)
    try:
        prio = _preemption_run(engine, (5, 0))
    finally:
        engine.shutdown()
    engine = LLMEngine(text_args(model_path, **small), multiprocess=multiprocess)
    try:
        with pytest.raises(ValueError, match="scheduling_policy"):
            engine.add_request("x", PROMPT, _params(2), priority=-1)
        fcfs = _preemption_run(engine, (0, 0))  # the reference: nobody is preempted
    finally:
        engine.shutdown()
    assert prio["low"].metrics.num_preemptions >= 1
    assert prio["high"].metrics.num_preemptions == 0
    assert fcfs["low"].metrics.num_preemptions == 0
    # Preempted work is recomputed: the tokens are those of the undisturbed run.
    for rid in ("low", "high"):
        assert prio[rid].outputs[0].token_ids == fcfs[rid].outputs[0].token_ids
    # The high-priority request finished first under priority, last under fcfs.
    assert prio["high"].metrics.finished_time < prio["low"].metrics.finished_time
    assert fcfs["high"].metrics.finished_time > fcfs["low"].metrics.finished_time


def test_async_llm_priority(model_path):
    engine = AsyncLLM(text_args(model_path, scheduling_policy="priority"))
    try:
        out = collect_async(engine, PROMPT, _params(4), "p1", priority=3)[-1]
        ref = collect_async(engine, PROMPT, _params(4), "p0")[-1]
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        with pytest.raises(ValueError, match="priority"):
            collect_async(engine, PROMPT, _params(4), "bad", priority="high")
    finally:
        engine.shutdown_sync()
