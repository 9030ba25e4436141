"""Engine control with vLLM's names, with the engine core in this process and in its own:
reset_prefix_cache, sleep / wake_up (generation after waking equals before), collective_rpc,
apply_model and get_metrics. The GPU memory that sleep returns is measured in
test_gpu_sleep_returns_memory (`-m gpu`)."""

from __future__ import annotations

import os

import pytest
from conftest import assert_all_blocks_free
from model_factory import make_tiny_model

from ember import LLM, SamplingParams

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22], [40, 41, 42]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return str(make_tiny_model("llama", tmp_path_factory.mktemp("ctl")))


@pytest.fixture(scope="module", params=[False, True], ids=["inproc", "core_process"])
def llm(request, tiny_path):
    saved = os.environ.get("EMBER_ENGINE_PROCESS")
    os.environ["EMBER_ENGINE_PROCESS"] = "1" if request.param else "0"
    try:
        engine = LLM(tiny_path, skip_tokenizer_init=True, max_model_len=128, block_size=4,
                     num_gpu_blocks_override=64, disable_log_stats=False,
                     enable_sleep_mode=True)
    finally:
        if saved is None:
            os.environ.pop("EMBER_ENGINE_PROCESS")
        else:
            os.environ["EMBER_ENGINE_PROCESS"] = saved
    assert engine.llm_engine.client.multiprocess is request.param
    yield engine
    engine.shutdown()


def _run(llm: LLM) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


# Worker functions: module level, so plain pickle carries them to a core process.
def _num_kv_caches(worker) -> int:
    return len(worker.kv_caches)


def _weight_elements(model) -> int:
    return sum(p.numel() for p in model.parameters())


def _num_layers(model) -> int:
    return len(model.model.layers)


def _add(worker, a, b=0):
    return a + b


def _fails(worker):
    raise KeyError("from the worker")


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_and_wake_up_keep_outputs(llm, level):
    before = _run(llm)
    weights = llm.apply_model(_weight_elements)[0]
    llm.sleep(level=level)
    assert llm.is_sleeping()
    assert llm.collective_rpc(_num_kv_caches) == [0]  # the KV cache is gone
    # Level 2 drops the weights; level 1 keeps them (in host memory, which on the CPU is where
    # they already are).
    assert llm.apply_model(_weight_elements) == [0 if level == 2 else weights]
    with pytest.raises(RuntimeError, match="sleeping"):
        llm.generate([{"prompt_token_ids": [1, 2, 3]}], GREEDY, use_tqdm=False)
    llm.wake_up()
    assert not llm.is_sleeping()
    assert llm.apply_model(_weight_elements) == [weights]
    assert _run(llm) == before
    assert_all_blocks_free(llm)


def test_wake_up_by_tags(llm):
    before = _run(llm)
    llm.sleep(level=2)
    llm.wake_up(tags=["weights"])
    assert llm.is_sleeping()  # the KV cache is still gone
    llm.wake_up(tags=["kv_cache"])
    assert not llm.is_sleeping()
    assert _run(llm) == before


def test_sleep_refuses_while_requests_run(llm):
    engine = llm.llm_engine
    engine.add_request("busy", {"prompt_token_ids": [3, 4, 5]}, GREEDY)
    try:
        with pytest.raises(RuntimeError, match="requests run"):
            llm.sleep()
    finally:
        engine.abort_request("busy")
    with pytest.raises(ValueError, match="level"):
        llm.sleep(level=3)


def test_reset_prefix_cache(llm):
    prompt = [{"prompt_token_ids": PROMPTS[0]}]
    llm.generate(prompt, GREEDY, use_tqdm=False)
    again = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens > 0
    assert llm.reset_prefix_cache() is True
    after = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    assert after.num_cached_tokens == 0
    assert list(after.outputs[0].token_ids) == list(again.outputs[0].token_ids)


def test_collective_rpc_and_apply_model(llm):
    assert llm.collective_rpc(_add, args=(2,), kwargs={"b": 3}) == [5]
    per_block = llm.collective_rpc("bytes_per_block")
    assert isinstance(per_block, list) and len(per_block) == 1 and per_block[0] > 0
    assert llm.apply_model(_num_layers) == [3]
    with pytest.raises(KeyError, match="from the worker"):
        llm.collective_rpc(_fails)  # the worker's exception, as itself
    with pytest.raises(ValueError, match="no method"):
        llm.collective_rpc("no_such_method")


def test_lambdas_in_process_or_through_cloudpickle(llm):
    try:
        import cloudpickle  # noqa: F401
        can_pickle = True
    except ImportError:
        can_pickle = False
    if llm.llm_engine.client.multiprocess and not can_pickle:
        with pytest.raises(ValueError, match="cloudpickle"):
            llm.apply_model(lambda model: 1)
    else:
        assert llm.apply_model(lambda model: model.num_layers) == [3]


def test_get_metrics(llm):
    from ember.engine.metrics import Counter, Gauge, Histogram

    def values(metrics):
        return {(m.name, m.labels.get("finished_reason")): m for m in metrics}

    before = values(llm.get_metrics())
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    after = values(llm.get_metrics())

    def delta(name, label=None):
        return after[name, label].value - before[name, label].value

    assert delta("ember:prompt_tokens") == sum(len(p) for p in PROMPTS)
    assert delta("ember:generation_tokens") == sum(len(o.outputs[0].token_ids) for o in outs)
    assert delta("ember:request_success", "length") == len(PROMPTS)
    assert delta("ember:prefix_cache_queries") > 0
    ttft = after["ember:time_to_first_token_seconds", None]
    assert isinstance(ttft, Histogram)
    assert ttft.count - before["ember:time_to_first_token_seconds", None].count == len(PROMPTS)
    assert list(ttft.buckets)[-1] == "+Inf" and ttft.buckets["+Inf"] == ttft.count
    assert isinstance(after["ember:num_requests_running", None], Gauge)
    assert after["ember:num_requests_running", None].value == 0
    assert isinstance(after["ember:prompt_tokens", None], Counter)


def test_metrics_and_sleep_need_their_flags(tiny_path):
    """As vLLM's: get_metrics needs disable_log_stats=False, sleep enable_sleep_mode=True."""
    llm = LLM(tiny_path, skip_tokenizer_init=True, max_model_len=128, num_gpu_blocks_override=64)
    with pytest.raises(ValueError, match="disable_log_stats=False"):
        llm.get_metrics()
    with pytest.raises(ValueError, match="enable_sleep_mode=True"):
        llm.sleep()
    with pytest.raises(ValueError, match="enable_sleep_mode=True"):
        llm.llm_engine.call_core("sleep", 1)  # the core checks too (other front ends)
    assert not llm.is_sleeping()
    llm.shutdown()


def _weight_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


@pytest.mark.gpu
def test_gpu_sleep_returns_memory(tmp_path):
    """Sleep returns the KV cache and the weights to the device (level 1 keeps the weights in
    pinned host memory, level 2 drops them); waking restores the same outputs. Measured with
    the platform's memory_in_use (the device's free memory), on a random 8-layer model of
    ~0.35 GiB of bf16 weights beside 0.5 GiB of KV cache (sizes printed with -s)."""
    path = make_tiny_model("llama", tmp_path, hidden_size=1024, intermediate_size=4096,
                           num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4,
                           head_dim=64, vocab_size=32000)
    llm = LLM(str(path), skip_tokenizer_init=True, max_model_len=256, block_size=16,
              num_gpu_blocks_override=4096, enable_sleep_mode=True)
    from ember.platforms import resolve_platform

    platform = resolve_platform(None)
    gib = 2**30
    kv_bytes = llm.llm_engine.num_total_blocks() * llm.collective_rpc("bytes_per_block")[0]
    weight_bytes = llm.apply_model(_weight_bytes)[0]
    before = _run(llm)
    awake = platform.memory_in_use()
    results = {}
    for level in (1, 2):
        llm.sleep(level=level)
        results[level] = platform.memory_in_use()
        llm.wake_up()
        assert _run(llm) == before
        results[f"{level} awake"] = platform.memory_in_use()
    print(f"KV {kv_bytes / gib:.3f} GiB, weights {weight_bytes / gib:.3f} GiB; in use: awake "
          f"{awake / gib:.3f} GiB, " + ", ".join(f"level {k} {v / gib:.3f} GiB"
                                                 for k, v in results.items()))
    for level in (1, 2):
        assert awake - results[level] >= 0.9 * (kv_bytes + weight_bytes), results
        assert results[f"{level} awake"] <= awake + 0.1 * kv_bytes, results  # nothing leaks
    llm.shutdown()


def test_sleep_right_after_generate_with_async_scheduling(tiny_path, monkeypatch):
    """With async scheduling the core may still hold a step planned before the last request
    ended when the front end asks it to sleep: that step is finished, not a reason to refuse."""
    monkeypatch.setenv("EMBER_ENGINE_PROCESS", "1")
    llm = LLM(tiny_path, skip_tokenizer_init=True, max_model_len=128, num_gpu_blocks_override=64,
              async_scheduling=True, enable_sleep_mode=True)
    try:
        before = _run(llm)
        for level in (1, 2, 1):
            llm.sleep(level=level)
            llm.wake_up()
            assert _run(llm) == before
    finally:
        llm.shutdown()
