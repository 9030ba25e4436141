"""SamplingParams.output_kind, min_tokens with stop strings, and RequestMetrics, through
LLMEngine.step() (engine core in this process and in its own) and AsyncLLM.generate().

The reference for DELTA and FINAL_ONLY is a CUMULATIVE run of the same requests on the same
engine: concatenated deltas (text, token ids, logprobs, per completion index, n > 1 and a stop
string held back included) must equal the cumulative result. For min_tokens the reference is the
unstopped greedy text cut by hand at the first stop string ending past the first min_tokens tokens.
"""

from __future__ import annotations

import pytest
from conftest import assert_all_blocks_free, assert_all_blocks_free_async
from text_model import (
    PROMPT,
    collect_async,
    final_by_index,
    join_deltas,
    make_text_model,
    run_engine,
    text_args,
)

from ember import SamplingParams
from ember.engine.async_llm import AsyncLLM
from ember.engine.llm_engine import LLMEngine
from ember.sampling_params import RequestOutputKind

KINDS = RequestOutputKind
MAX_NEW = 24


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return make_text_model(tmp_path_factory.mktemp("kinds"))


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


def _greedy_ids(engine) -> list[int]:
    [out] = run_engine(engine, [("ref", PROMPT, SamplingParams(
        temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, output_kind=KINDS.FINAL_ONLY))])
    return list(out.outputs[0].token_ids)


def _stop_string(text: str) -> str:
    """A stop string from the middle of the greedy text (several tokens long, usually)."""
    mid = len(text) // 2
    stop = text[mid:mid + 8]
    assert stop.strip(), text
    return stop


def _requests(stop: str, kind: RequestOutputKind) -> list[tuple[str, str, SamplingParams]]:
    common = dict(max_tokens=MAX_NEW, ignore_eos=True, stop=[stop], output_kind=kind)
    return [
        ("greedy", PROMPT, SamplingParams(temperature=0.0, logprobs=2, **common)),
        # n > 1 with seeded sampling: distinct children, each cut by the stop string or not.
        ("n3", PROMPT, SamplingParams(n=3, temperature=1.0, seed=11, **common)),
        ("n2_incl", PROMPT, SamplingParams(n=2, temperature=0.0, include_stop_str_in_output=True,
                                           **common)),
        # No stop string: FINAL_ONLY detokenizes these once they end (decode_at_end), the
        # others as each token comes; special tokens kept with spaces take the window's path.
        ("no_stop", PROMPT, SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=MAX_NEW,
                                           ignore_eos=True, output_kind=kind)),
        ("no_stop_special", PROMPT, SamplingParams(
            temperature=1.0, seed=6, max_tokens=MAX_NEW, ignore_eos=True, output_kind=kind,
            skip_special_tokens=False, spaces_between_special_tokens=True)),
    ]


NO_STOP = ("no_stop", "no_stop_special")


def _by_request(outputs) -> dict[str, list]:
    grouped: dict[str, list] = {}
    for out in outputs:
        grouped.setdefault(out.request_id, []).append(out)
    return grouped


def _check_kinds(cumulative: dict, delta: dict, final: dict, stop: str,
                 one_token_per_delta: bool = True) -> None:
    """``one_token_per_delta``: each DELTA output carries one new token. AsyncLLM joins the
    deltas that queue up while its consumer is busy (as vLLM's output collector does), so
    there it depends on timing and is not checked."""
    for request_id, outs in cumulative.items():
        reference = final_by_index(outs[-1])
        assert outs[-1].finished
        # CUMULATIVE: every output holds the text so far, a prefix of the final one.
        for out in outs:
            for c in out.outputs:
                assert reference[c.index][0].startswith(c.text)
        # DELTA: the pieces concatenate to the cumulative result; no piece repeats old text.
        assert join_deltas(delta[request_id]) == reference, request_id
        assert delta[request_id][-1].finished
        if one_token_per_delta:
            assert max(len(c.token_ids) for o in delta[request_id] for c in o.outputs) == 1
        if request_id != "n2_incl" and request_id not in NO_STOP:
            assert all(stop not in c.text for o in delta[request_id] for c in o.outputs)
        # FINAL_ONLY: one output, the final one.
        assert len(final[request_id]) == 1 and final[request_id][0].finished
        assert final_by_index(final[request_id][0]) == reference
    assert cumulative["greedy"][-1].outputs[0].finish_reason == "stop"


def test_output_kinds_agree(engine):
    tokenizer = engine.get_tokenizer()
    stop = _stop_string(tokenizer.decode(_greedy_ids(engine)))
    runs = {kind: _by_request(run_engine(engine, _requests(stop, kind))) for kind in KINDS}
    _check_kinds(runs[KINDS.CUMULATIVE], runs[KINDS.DELTA], runs[KINDS.FINAL_ONLY], stop)
    # DELTA logprobs are per new token too, and join up to the cumulative list.
    # (Values to float tolerance: a later run's prompt hits the prefix cache, computed apart.)
    delta_lps = [lp for o in runs[KINDS.DELTA]["greedy"] for c in o.outputs for lp in c.logprobs]
    cumulative_lps = runs[KINDS.CUMULATIVE]["greedy"][-1].outputs[0].logprobs
    assert [list(d) for d in delta_lps] == [list(d) for d in cumulative_lps]
    assert [v.logprob for d in delta_lps for v in d.values()] == pytest.approx(
        [v.logprob for d in cumulative_lps for v in d.values()], abs=1e-4)
    assert_all_blocks_free(engine)


def test_async_output_kinds_agree(async_engine):
    tokenizer = async_engine.tokenizer
    ids = list(collect_async(async_engine, PROMPT, SamplingParams(
        temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True), "ref")[-1].outputs[0].token_ids)
    stop = _stop_string(tokenizer.decode(ids))
    runs: dict = {}
    for kind in KINDS:
        runs[kind] = {rid: collect_async(async_engine, prompt, params, f"{kind.name}-{rid}")
                      for rid, prompt, params in _requests(stop, kind)}
    _check_kinds(runs[KINDS.CUMULATIVE], runs[KINDS.DELTA], runs[KINDS.FINAL_ONLY], stop,
                 one_token_per_delta=False)
    import asyncio

    asyncio.run(assert_all_blocks_free_async(async_engine))


def _min_tokens_case(tokenizer, ids: list[int]) -> tuple[str, int, str, str]:
    """(stop string, min_tokens, text expected without and with min_tokens): the stop string
    completes within the first min_tokens tokens and again later."""
    full = tokenizer.decode(ids)
    pieces = [tokenizer.decode(ids[:k]) for k in range(len(ids) + 1)]
    for first in range(1, len(ids) - 2):
        stop = full[len(pieces[first]) - 3:len(pieces[first])]  # the first token's last chars
        if len(stop) < 3 or not stop.strip() or full.find(stop) != len(pieces[first]) - 3:
            continue
        for min_tokens in range(first, len(ids) - 1):
            later = full.find(stop, len(pieces[min_tokens]) - len(stop) + 1)
            if later != -1:
                return stop, min_tokens, full[:full.find(stop)], full[:later]
    pytest.fail(f"no repeated stop string in the greedy text {full!r}")


def test_min_tokens_holds_back_stop_strings(engine):
    ids = _greedy_ids(engine)
    stop, min_tokens, without, expected = _min_tokens_case(engine.get_tokenizer(), ids)
    params = dict(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, stop=[stop],
                  output_kind=KINDS.FINAL_ONLY)
    [plain] = run_engine(engine, [("plain", PROMPT, SamplingParams(**params))])
    [held] = run_engine(engine, [("held", PROMPT, SamplingParams(min_tokens=min_tokens, **params))])
    assert plain.outputs[0].text == without and plain.outputs[0].finish_reason == "stop"
    assert held.outputs[0].text == expected and held.outputs[0].finish_reason == "stop"
    assert len(held.outputs[0].token_ids) > min_tokens
    assert_all_blocks_free(engine)


def test_async_min_tokens_holds_back_stop_strings(async_engine):
    ids = list(collect_async(async_engine, PROMPT, SamplingParams(
        temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True), "mt-ref")[-1].outputs[0].token_ids)
    stop, min_tokens, without, expected = _min_tokens_case(async_engine.tokenizer, ids)
    params = dict(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, stop=[stop],
                  output_kind=KINDS.DELTA)
    held = collect_async(async_engine, PROMPT, SamplingParams(min_tokens=min_tokens, **params),
                         "mt-held")
    assert join_deltas(held)[0][0] == expected
    plain = collect_async(async_engine, PROMPT, SamplingParams(**params), "mt-plain")
    assert join_deltas(plain)[0][0] == without


def _check_metrics(metrics) -> None:
    assert metrics is not None
    times = [metrics.arrival_time, metrics.first_scheduled_time, metrics.first_token_time,
             metrics.last_token_time, metrics.finished_time]
    assert None not in times, metrics
    assert times == sorted(times), metrics
    assert metrics.time_in_queue == pytest.approx(
        metrics.first_scheduled_time - metrics.arrival_time)


def test_request_metrics_filled(engine, async_engine):
    params = SamplingParams(temperature=0.0, max_tokens=4, n=2, output_kind=KINDS.FINAL_ONLY)
    [out] = run_engine(engine, [("metrics", PROMPT, params)])
    _check_metrics(out.metrics)
    _check_metrics(collect_async(async_engine, PROMPT, params, "metrics")[-1].metrics)


def test_delta_prompt_logprobs_come_once(engine):
    params = dict(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=1)
    [*_, cumulative] = run_engine(engine, [("plp-c", PROMPT, SamplingParams(**params))])
    delta = run_engine(engine, [("plp-d", PROMPT, SamplingParams(
        output_kind=KINDS.DELTA, **params))])
    assert len(delta) > 1
    carried = [o.prompt_logprobs for o in delta if o.prompt_logprobs]
    assert len(carried) == 1 and delta[0].prompt_logprobs is carried[0]
    assert len(carried[0]) == len(cumulative.prompt_logprobs) == len(cumulative.prompt_token_ids)
    assert [list(d or {}) for d in carried[0]] == [list(d or {}) for d in cumulative.prompt_logprobs]


def test_merge_delta_outputs():
    """AsyncLLM joins DELTA outputs that queued up for a slow consumer."""
    from ember.engine.output_processor import merge_delta_outputs
    from ember.outputs import CompletionOutput, RequestOutput

    def out(pieces, finished=False):
        return RequestOutput("r", None, [1], [
            CompletionOutput(i, text, ids, finish_reason="stop" if finished else None)
            for i, text, ids in pieces], finished)

    merged = merge_delta_outputs(out([(0, "a", [1]), (1, "x", [7])]),
                                 out([(1, "y", [8]), (2, "q", [9])], finished=True))
    assert [(c.index, c.text, c.token_ids, c.finish_reason) for c in merged.outputs] == [
        (0, "a", [1], None), (1, "xy", [7, 8], "stop"), (2, "q", [9], "stop")]
    assert merged.finished


def _core_outputs_per_request(engine, requests) -> tuple[list, dict[str, list]]:
    """run_engine, recording each EngineCoreOutput the front end folds in, by request id."""
    seen: dict[str, list] = {}
    process = engine.output_processor.process

    def recording(core_outputs):
        for out in core_outputs.outputs:
            seen.setdefault(out.request_id, []).append(out)
        return process(core_outputs)

    engine.output_processor.process = recording
    try:
        return run_engine(engine, requests), seen
    finally:
        del engine.output_processor.process


def test_final_only_outputs_come_once_from_the_core(engine):
    """A FINAL_ONLY request with nothing to check per token has the core send its tokens once,
    when it ends (outputs_at_end): the same result as per-step outputs, and its token times;
    one with a stop string or logprobs still gets an output a step."""
    reference = {o.request_id: o for o in run_engine(engine, [
        (f"ref{i}", PROMPT, SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=MAX_NEW,
                                           ignore_eos=True)) for i in range(2)]) if o.finished}
    final = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=MAX_NEW, ignore_eos=True,
                           output_kind=KINDS.FINAL_ONLY)
    stop = _stop_string(reference["ref0"].outputs[0].text)
    outputs, seen = _core_outputs_per_request(engine, [
        ("end0", PROMPT, final), ("end1", PROMPT, final),
        ("stop", PROMPT, SamplingParams(temperature=0.0, max_tokens=MAX_NEW, stop=[stop],
                                        output_kind=KINDS.FINAL_ONLY)),
        ("logprobs", PROMPT, SamplingParams(temperature=0.0, max_tokens=MAX_NEW, logprobs=1,
                                            ignore_eos=True, output_kind=KINDS.FINAL_ONLY))])
    by_id = {o.request_id: o for o in outputs}
    assert len(outputs) == 4 and all(o.finished for o in outputs)
    for i in range(2):
        assert final_by_index(by_id[f"end{i}"]) == final_by_index(reference[f"ref{i}"])
        _check_metrics(by_id[f"end{i}"].metrics)
    ends = [outs for rid, outs in seen.items() if rid.endswith(("_end0", "_end1"))]
    assert len(ends) == 4  # two children each
    for outs in ends:
        assert len(outs) == 1 and len(outs[0].new_token_ids) == MAX_NEW
        assert outs[0].finish_reason == "length" and outs[0].first_token_time > 0
    assert len(seen["stop"]) > 1 and len(seen["logprobs"]) == MAX_NEW
    assert_all_blocks_free(engine)


def test_aborted_outputs_at_end_request_frees_its_blocks(engine):
    params = SamplingParams(max_tokens=400, ignore_eos=True, output_kind=KINDS.FINAL_ONLY)
    engine.add_request("long", PROMPT, params)
    engine.step()
    engine.step()
    [final] = engine.abort_request("long")
    assert final.finished and final.outputs[0].finish_reason == "abort"
    while engine.has_unfinished_requests():
        assert engine.step() == []
    assert_all_blocks_free(engine)
