"""Scheduler: token budget, chunked prefill, max_num_seqs, preemption by recompute."""

from ember.core.kv_cache_manager import KVCacheManager
from ember.core.request import Request
from ember.core.scheduler import Scheduler
from ember.core.scheduler_output import ModelRunnerOutput
from ember.sampling_params import SamplingParams

BS = 4


def make(num_blocks=64, budget=32, max_seqs=8, caching=True):
    kv = KVCacheManager(num_blocks, BS, caching)
    return Scheduler(kv, budget, max_seqs, max_model_len=256), kv


def add(sched, rid, n_prompt, max_tokens=4):
    req = Request(rid, list(range(1, n_prompt + 1)), SamplingParams(max_tokens=max_tokens), {0}, BS)
    sched.add_request(req)
    return req


def fake_step(sched):
    """Schedule one step and pretend the model sampled token 7 for every caught-up request."""
    out = sched.schedule()
    result = ModelRunnerOutput()
    for rid in out.num_scheduled_tokens:
        req = sched.requests[rid]
        if req.num_computed_tokens == req.num_tokens:  # (progress advances at scheduling)
            result.sampled_token_ids[rid] = 7
    sched.update_from_output(out, result)
    return out


def test_budget_chunks_long_prompts_and_mixes_decodes():
    sched, _ = make(budget=16)
    add(sched, "a", 40)
    out = fake_step(sched)
    assert out.num_scheduled_tokens == {"a": 16}
    add(sched, "b", 3)
    out = fake_step(sched)
    assert out.num_scheduled_tokens == {"a": 16}  # a takes the whole budget
    out = fake_step(sched)
    assert out.num_scheduled_tokens == {"a": 8, "b": 3}  # rest of a, then b joins
    out = fake_step(sched)
    assert out.num_scheduled_tokens == {"a": 1, "b": 1}  # two decodes


def test_max_num_seqs_bounds_running_requests():
    sched, _ = make(max_seqs=2)
    for i in range(4):
        add(sched, str(i), 3)
    out = fake_step(sched)
    assert set(out.num_scheduled_tokens) == {"0", "1"}


def test_preemption_frees_blocks_and_request_resumes():
    sched, kv = make(num_blocks=4, budget=64)
    add(sched, "a", 7, max_tokens=6)
    add(sched, "b", 7, max_tokens=6)
    steps = 0
    while sched.has_unfinished_requests() and steps < 100:
        fake_step(sched)
        steps += 1
    assert not sched.has_unfinished_requests()
    assert sched.num_preemptions > 0
    assert kv.num_free_blocks == 4


def test_finished_requests_free_their_blocks():
    sched, kv = make(num_blocks=16)
    add(sched, "a", 5, max_tokens=2)
    fake_step(sched)
    fake_step(sched)
    assert not sched.has_unfinished_requests() and kv.num_free_blocks == 16
    out = sched.schedule()
    assert "a" in out.finished_req_ids  # workers are told to drop it


def test_abort_frees_waiting_and_running():
    from ember.core.request import RequestStatus

    sched, kv = make(num_blocks=16, max_seqs=1)
    add(sched, "a", 5)
    add(sched, "b", 5)
    fake_step(sched)
    sched.finish_requests(["a", "b"], RequestStatus.FINISHED_ABORTED)
    assert not sched.has_unfinished_requests() and kv.num_free_blocks == 16


def test_preempted_then_aborted_request_is_dropped_by_workers():
    from ember.core.request import RequestStatus

    sched, kv = make(num_blocks=4, budget=64)
    add(sched, "a", 7, max_tokens=6)
    add(sched, "b", 7, max_tokens=6)
    preempted = set()
    for _ in range(20):
        out = fake_step(sched)
        preempted |= out.preempted_req_ids
        if preempted:
            break
    assert preempted, "the small cache did not preempt"
    victim = preempted.pop()
    sched.finish_requests([victim], RequestStatus.FINISHED_ABORTED)
    assert victim in sched.schedule().finished_req_ids  # workers free its kept state
