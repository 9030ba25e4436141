"""Pipeline parallelism with several batches in flight (the engine core's batch queue) on the
CPU (gloo): greedy tokens of PP=2 and TP=2 x PP=2 equal the one-process engine's with mixed
prompt lengths, more requests than one batch takes, preemption (a small KV cache) and prefix
caching, and with structured outputs; more than one batch really was in flight; an abort while
batches are in flight frees everything; the scheduler never puts a request in two batches in
flight.

Each engine start spawns one process per rank (20-40 s on a loaded 2-core machine), so the
default run starts three multi-rank engines (PP=2, TP=2 x PP=2, PP=2 with grammars) and checks
several things on each.
"""

from __future__ import annotations

import re

import pytest
from model_factory import make_tiny_model

from ember import LLM, SamplingParams, TokensPrompt
from ember.config import EngineArgs
from ember.core.kv_cache_manager import KVCacheManager
from ember.core.request import Request
from ember.core.scheduler import Scheduler

# Mixed lengths; a shared 32-token prefix (prefix caching) on the last three; the long one
# prefills in chunks (max_num_batched_tokens=32).
PREFIX = list(range(100, 132))
PROMPTS = ([[3, 4, 5, 6, 7], [9, 8, 7], list(range(10, 50)), [11] * 17, [5, 6]]
           + [PREFIX + [i, i + 1] for i in range(3)])
GREEDY = SamplingParams(temperature=0.0, max_tokens=12)
# 40 blocks x 4 tokens: eight requests of up to 46 tokens do not fit at once (preemption).
ENGINE = dict(skip_tokenizer_init=True, num_gpu_blocks_override=40, block_size=4,
              max_model_len=64, max_num_seqs=8, max_num_batched_tokens=32, show_progress=False)


def _generate(llm: LLM, prompts=PROMPTS) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in
            llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], GREEDY,
                         use_tqdm=False)]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> tuple[str, list[list[int]]]:
    """A tiny random Qwen3 (q/k norm, 4 layers) and its one-process greedy tokens."""
    path = str(make_tiny_model("qwen3", tmp_path_factory.mktemp("pp"), num_hidden_layers=4))
    llm = LLM(model=path, **ENGINE)
    try:
        ref = _generate(llm)
        assert llm.llm_engine.scheduler.num_preemptions > 0  # the cache is small enough
    finally:
        llm.shutdown()
    return path, ref


def _check_overlap(path: str, ref: list[list[int]], tp: int, **kw) -> None:
    llm = LLM(model=path, tensor_parallel_size=tp, pipeline_parallel_size=2,
              distributed_executor_backend="mp", **ENGINE, **kw)
    try:
        core = llm.llm_engine.engine_core
        assert core.max_concurrent_batches == 2
        assert _generate(llm) == ref
        assert core.peak_batches_in_flight == 2  # the stages did have a batch each
        # Per rank, the batches stage 0 started before the last stage had sampled the batch
        # before (its token broadcast not yet complete): the stages ran at once. The last
        # stage finishes each batch before taking the next, so it counts none.
        counts = llm.collective_rpc("overlap_count")
        assert all(c > 0 for c in counts[:tp]) and counts[tp:] == [0] * tp, counts
        assert core.scheduler.num_preemptions > 0
        assert core.kv_cache_manager.prefix_hits > 0
        # Abort while batches are in flight: the others finish, every block comes back.
        engine = llm.llm_engine
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(f"a{i}", TokensPrompt(prompt_token_ids=prompt), GREEDY)
        engine.step()
        engine.step()  # the core returns with one batch still in flight
        aborted = [f"a{i}" for i in range(0, len(PROMPTS), 2)]
        assert core._batch_queue and core.scheduler.in_flight_ids & set(aborted)
        engine.abort_request(aborted)
        finished = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out.outputs[0].token_ids
        expected = {f"a{i}": ref[i] for i in range(1, len(PROMPTS), 2)}
        assert {k: v for k, v in finished.items() if k in expected} == expected
        assert core.idle_report()["requests_holding_blocks"] == 0
        assert core.kv_cache_manager.num_free_blocks == core.kv_cache_manager.pool.num_blocks
        assert not core.scheduler.in_flight_ids
        # Again after the abort: the workers' states are consistent.
        assert _generate(llm, PROMPTS[:3]) == ref[:3]
    finally:
        llm.shutdown()


@pytest.mark.slow
def test_pp2_batch_queue_equals_one_process(model):
    _check_overlap(*model, tp=1)


@pytest.mark.slow
def test_tp2_pp2_batch_queue_equals_one_process(model):
    """With async scheduling too (its placeholders are resolved before a request returns)."""
    _check_overlap(*model, tp=2, async_scheduling=True)


def test_max_concurrent_batches_args():
    assert EngineArgs(model="m", pipeline_parallel_size=3).concurrent_batches() == 3
    assert EngineArgs(model="m", pipeline_parallel_size=3,
                      max_concurrent_batches=1).concurrent_batches() == 1
    assert EngineArgs(model="m").concurrent_batches() == 1
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="max_concurrent_batches"):
            EngineArgs(model="m", max_concurrent_batches=bad)._validate_parallel()
    with pytest.raises(ValueError, match="max_concurrent_batches=2 needs pipeline_parallel"):
        EngineArgs(model="m", max_concurrent_batches=2)._validate_parallel()


def _request(req_id: str, n: int) -> Request:
    params = SamplingParams(temperature=0.0, max_tokens=4)
    params.all_stop_token_ids = set()
    return Request(req_id, list(range(1, n + 1)), params, set(), 4, 0.0)


def test_scheduler_batch_queue_keeps_requests_in_one_batch():
    """Two batches in flight take disjoint requests, each about half; a request returns to a
    batch only once its batch's result is folded in."""
    from ember.core.scheduler_output import ModelRunnerOutput

    sched = Scheduler(KVCacheManager(64, 4, True), 64, 8, 64, max_concurrent_batches=2)
    for i in range(5):
        sched.add_request(_request(f"r{i}", 3 + i))
    first = sched.schedule()
    second = sched.schedule()
    assert set(first.num_scheduled_tokens) == {"r0", "r1", "r2"}
    assert set(second.num_scheduled_tokens) == {"r3", "r4"}
    assert sched.schedule().is_empty  # everything is in flight
    sched.update_from_output(first, ModelRunnerOutput({f"r{i}": 7 for i in range(3)}))
    third = sched.schedule()
    assert set(third.num_scheduled_tokens) == {"r0", "r1", "r2"}
    assert all(n == 1 for n in third.num_scheduled_tokens.values())  # decodes of known tokens
    assert sched.in_flight_ids == {f"r{i}" for i in range(5)}
    sched.finish_requests(["r3"], _aborted())
    assert sched.schedule().is_empty
    sched.update_from_output(second, ModelRunnerOutput({"r3": 1, "r4": 2}))
    fourth = sched.schedule()
    assert set(fourth.num_scheduled_tokens) == {"r4"}
    assert "r3" in fourth.finished_req_ids  # kept until a batch went out


def _aborted():
    from ember.core.request import RequestStatus

    return RequestStatus.FINISHED_ABORTED


@pytest.mark.slow
def test_pp2_batch_queue_structured_outputs(tmp_path):
    """Grammar requests among plain ones: the bitmask is filled when a batch is scheduled (the
    request's previous token is folded in by then); tokens equal the one-process engine's."""
    from ember import StructuredOutputsParams
    from ember.default_model import default_model_path

    path = str(make_tiny_model("llama", tmp_path, vocab_size=49152, num_hidden_layers=2))
    args = dict(model=path, tokenizer=default_model_path(), max_model_len=64, max_num_seqs=8,
                kv_cache_memory_bytes=1 << 23, show_progress=False)
    prompts = ["The quick brown fox", "Once upon a time", "Pick one:", "A number:"]
    grammar = [None, None, StructuredOutputsParams(choice=["red", "green", "blue"]),
               StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]{2}")]
    params = [SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=g)
              for g in grammar]

    def run(**kw) -> list[tuple[list[int], str]]:
        llm = LLM(**args, **kw)
        try:
            return [(o.outputs[0].token_ids, o.outputs[0].text)
                    for o in llm.generate(prompts, params, use_tqdm=False)]
        finally:
            llm.shutdown()

    ref = run()
    assert ref[2][1] in ("red", "green", "blue")
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", ref[3][1])
    assert run(pipeline_parallel_size=2, distributed_executor_backend="mp") == ref
