"""The grammar process (EMBER_GRAMMAR_PROCESS=1, the default where sampling waits for the bitmask
on a GPU): the same tokens as the grammars on the engine's threads, synchronous and async
scheduling, n > 1 and unconstrained requests in the batch; matchers freed with their requests; a
backend's build error reported as one; the process's death an error, not a hang; nothing left
behind by shutdown (process, shared files)."""

from __future__ import annotations

import gc
import glob
import json

import pytest
from conftest import assert_all_blocks_free

from ember import LLM, SamplingParams, StructuredOutputsParams
from ember.structured_output.interface import StructuredOutputBackend
from ember.structured_output.xgrammar_backend import XgrammarBackend

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]},
                                                    "maxItems": 3}},
          "required": ["name", "tags"]}
PROMPTS = ["Give a person as JSON.", "A city:", "Pick one:", "Tags:", "Write a regex match:"]


def _params() -> list[SamplingParams]:
    so = StructuredOutputsParams
    return [SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=so(json=SCHEMA)),
            SamplingParams(temperature=0.0, max_tokens=8,
                           structured_outputs=so(choice=["Paris", "London", "Berlin"])),
            SamplingParams(temperature=0.0, max_tokens=12),  # unconstrained in the batch
            SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=30,
                           structured_outputs=so(json=SCHEMA)),
            SamplingParams(temperature=0.0, max_tokens=16,
                           structured_outputs=so(regex=r"[a-z]{2,6}-\d{3}"))]


def _token_ids(llm: LLM) -> list[list[list[int]]]:
    outs = llm.generate(PROMPTS, _params(), use_tqdm=False)
    return [[list(c.token_ids) for c in o.outputs] for o in outs]


def _shared_files() -> set[str]:
    return set(glob.glob("/dev/shm/ember-grammar-*"))


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_the_process_gives_the_threads_tokens(monkeypatch, async_scheduling):
    before = _shared_files()
    monkeypatch.setenv("EMBER_GRAMMAR_PROCESS", "0")
    threads = LLM(max_model_len=256, async_scheduling=async_scheduling)
    assert not threads.llm_engine.engine_core.structured_output.uses_process
    expected = _token_ids(threads)
    threads.shutdown()
    monkeypatch.setenv("EMBER_GRAMMAR_PROCESS", "1")
    llm = LLM(max_model_len=256, async_scheduling=async_scheduling)
    manager = llm.llm_engine.engine_core.structured_output
    assert manager.uses_process and manager.defer_accepts
    if async_scheduling:  # both sides poll before they block, as on a GPU host
        manager._process_args["spin_seconds"] = 0.002
    assert _token_ids(llm) == expected
    outs = llm.generate(PROMPTS[:1], _params()[:1], use_tqdm=False)
    json.loads(outs[0].outputs[0].text)
    assert_all_blocks_free(llm)
    # The finished requests' matchers are gone: the last fill saw only its own request's.
    gc.collect()
    llm.generate(PROMPTS[:1], _params()[:1], use_tqdm=False)
    assert manager._process.live_grammars == 1
    process = manager._process.process
    llm.shutdown()
    assert process.poll() is not None  # exited
    assert _shared_files() <= before  # every buffer unlinked


class FailingBackend(StructuredOutputBackend):
    """Refuses nothing up front, fails every compile (module level: the process imports it)."""

    @classmethod
    def validate(cls, spec):
        return None

    def __init__(self, tokenizer, vocab_size, config):
        pass

    def compile(self, spec):
        raise RuntimeError(f"cannot compile {spec.kind} here")

    def new_grammar(self, compiled, stop_token_ids):
        raise AssertionError("never built")


class SecondBuildFailsBackend(XgrammarBackend):
    """xgrammar whose second matcher fails to build (module level: the process imports it)."""

    builds = 0

    def new_grammar(self, compiled, stop_token_ids):
        type(self).builds += 1
        if type(self).builds > 1:
            raise RuntimeError("no second matcher here")
        return super().new_grammar(compiled, stop_token_ids)


def test_a_build_error_in_the_process_ends_its_request_only(monkeypatch):
    from ember.registry import GrammarBackendRegistry, isolated

    monkeypatch.setenv("EMBER_GRAMMAR_PROCESS", "1")
    with isolated():
        GrammarBackendRegistry.register_grammar_backend("failing_here", FailingBackend)
        llm = LLM(max_model_len=128, structured_outputs_config={"backend": "failing_here"})
        outs = llm.generate(["a", "b"], [
            SamplingParams(max_tokens=5, structured_outputs=StructuredOutputsParams(regex="x+")),
            SamplingParams(max_tokens=5)], use_tqdm=False)
        assert outs[0].outputs[0].finish_reason == "abort"
        assert len(outs[1].outputs[0].token_ids) == 5
        assert_all_blocks_free(llm)
        llm.shutdown()


def test_the_process_dying_is_an_error_not_a_hang(monkeypatch):
    monkeypatch.setenv("EMBER_GRAMMAR_PROCESS", "1")
    llm = LLM(max_model_len=128)
    params = SamplingParams(temperature=0.0, max_tokens=20,
                            structured_outputs=StructuredOutputsParams(json=SCHEMA))
    llm.generate(PROMPTS[:1], params, use_tqdm=False)  # starts it
    process = llm.llm_engine.engine_core.structured_output._process.process
    process.kill()
    process.wait()
    with pytest.raises(RuntimeError, match="grammar process exited"):
        llm.generate(PROMPTS[:1], params, use_tqdm=False)


def test_grammar_process_setting(monkeypatch):
    from ember import envs

    for value, expected in [(None, None), ("auto", None), ("0", False), ("1", True)]:
        if value is None:
            monkeypatch.delenv("EMBER_GRAMMAR_PROCESS", raising=False)
        else:
            monkeypatch.setenv("EMBER_GRAMMAR_PROCESS", value)
        assert envs.grammar_process() is expected
    monkeypatch.setenv("EMBER_GRAMMAR_PROCESS", "yes")
    with pytest.raises(ValueError, match="EMBER_GRAMMAR_PROCESS"):
        envs.grammar_process()
    # The default on the CPU (no device to wait for): the engine's threads.
    monkeypatch.delenv("EMBER_GRAMMAR_PROCESS")
    core = LLM(max_model_len=128, device="cpu").llm_engine.engine_core
    assert not core.structured_output.uses_process


@pytest.mark.gpu
def test_on_a_gpu_the_process_is_the_default_and_fills_page_locked_memory(monkeypatch,
                                                                          tmp_path):
    from test_structured_outputs import _byte_level_model

    model = _byte_level_model(tmp_path)  # the GPU machine has no default model
    monkeypatch.delenv("EMBER_GRAMMAR_PROCESS", raising=False)
    llm = LLM(model, max_model_len=256, device="cuda")
    manager = llm.llm_engine.engine_core.structured_output
    assert manager.uses_process and llm.llm_engine.engine_core.defers_grammar_sampling
    tokens = _token_ids(llm)
    buffers = [b for b in manager._process._buffers if b is not None]
    assert buffers and all(b.tensor.is_pinned() for b in buffers)
    llm.shutdown()
    monkeypatch.setenv("EMBER_GRAMMAR_PROCESS", "0")
    assert _token_ids(LLM(model, max_model_len=256, device="cuda")) == tokens


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
def test_built_in_backends_fill_whole_rows(backend):
    """The built-in backends declare fills_whole_rows (the bitmask is not cleared before a
    fill): a row that held garbage comes out as one that held all ones."""
    import torch

    from ember.default_model import default_model_path
    from ember.structured_output.compiler import GrammarCompiler, fill_grammar_rows
    from ember.structured_output.config import StructuredOutputsConfig
    from ember.structured_output.interface import GrammarSpec
    from ember.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(default_model_path())
    compiler = GrammarCompiler(StructuredOutputsConfig(backend=backend), lambda: tokenizer, 0)
    spec = GrammarSpec.of(StructuredOutputsParams(json=SCHEMA))
    grammars = [compiler.build(backend, spec, [tokenizer.eos_token_id]) for _ in range(2)]
    assert compiler.backends[backend].fills_whole_rows
    for token in tokenizer.encode('{"name": "ab', add_special_tokens=False):
        assert grammars[1].accept_token(token)
    words = (compiler.vocab_size + 31) // 32
    garbage = torch.full((3, words), 0x55555555, dtype=torch.int32)
    ones = torch.full((3, words), -1, dtype=torch.int32)
    for bitmask in (garbage, ones):
        for grammar, row in zip(grammars, (0, 2)):
            grammar.fill_bitmask(bitmask, row)
    assert torch.equal(garbage[[0, 2]], ones[[0, 2]])
    # fill_grammar_rows: rows no backend writes (1 here) come out all ones.
    fill_grammar_rows(compiler.backends, {backend: (grammars, [0, 2])}, garbage)
    assert torch.equal(garbage, ones)


def test_cloned_params_share_only_what_never_changes():
    """SamplingParams.clone (once per request made) copies what can change and shares the rest:
    the structured-output constraint's values are shared, its per-request fields are not."""
    from ember.structured_output.interface import GrammarSpec

    params = SamplingParams(stop=["x"], logit_bias={1: 2.0}, extra_args={"a": [1]},
                            structured_outputs=StructuredOutputsParams(json=SCHEMA))
    params.all_stop_token_ids = {3}
    clone = params.clone()
    assert clone == params
    assert clone.stop is not params.stop and clone.logit_bias is not params.logit_bias
    assert clone.extra_args["a"] is not params.extra_args["a"]
    assert clone.all_stop_token_ids is not params.all_stop_token_ids
    so, cloned_so = params.structured_outputs, clone.structured_outputs
    assert cloned_so is not so and cloned_so.json is so.json
    cloned_so._backend, cloned_so._spec = "guidance", GrammarSpec.of(cloned_so)
    assert so._backend is None and so._spec is None


def test_add_requests_benchmark_runs(tmp_path):
    """ember.bench.add_requests at a toy size."""
    from ember.bench import add_requests

    out = tmp_path / "add.json"
    assert add_requests.main(["--requests", "8", "--rounds", "1", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert set(result["us_per_request"]) == {"json_schema", "plain"}
    assert all(0 < us < 1e6 for us in result["us_per_request"].values())


def test_the_process_side_keeps_each_grammars_state():
    """The grammar process's own steps (run here, without a pipe): each token goes to its key's
    grammar in order (a key twice in one message too); freed keys and ended grammars take
    nothing and their rows allow every token; the grammars that end are answered by key; with
    a reasoning parser the gate lives there: reasoning rows are free, the end tag is not the
    grammar's, and an undecided row also allows the start tag."""
    import functools

    import numpy as np
    import torch

    from ember.default_model import default_model_path
    from ember.structured_output.config import StructuredOutputsConfig
    from ember.structured_output.grammar_server import _GrammarServer
    from ember.structured_output.interface import GrammarSpec
    from ember.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(default_model_path())
    eos = tokenizer.eos_token_id
    sent = []

    class Pipe:
        send = staticmethod(sent.append)

    def server(**config):
        config = StructuredOutputsConfig.of({"backend": "xgrammar", **config})
        made = _GrammarServer(Pipe(), config, functools.partial(load_tokenizer,
                                                                 default_model_path()),
                              len(tokenizer), eos + 1)
        made.pool.shutdown()
        return made

    def allowed(row) -> set[int]:
        bits = np.unpackbits(row.numpy().view(np.uint8), bitorder="little")
        return set(np.flatnonzero(bits).tolist())

    spec = GrammarSpec.of(StructuredOutputsParams(choice=["yes", "no"]))
    yes = tokenizer.encode("yes", add_special_tokens=False)
    words = (len(tokenizer) + 31) // 32
    plain = server()
    for key in (1, 2):
        plain._build(key, "xgrammar", spec, [eos], None)
    assert [m[:3] for m in sent] == [("built", 1, None), ("built", 2, None)]
    # Key 1 takes "yes" then eos in one message (the same key twice): complete, answered.
    assert plain._accept([1] * len(yes) + [1, 7], yes + [eos, 5]) == [(1, True)]
    bitmask = torch.zeros(3, words, dtype=torch.int32)
    plain._fill_rows([1, 2, 7], bitmask)
    everything = allowed(torch.full((words,), -1, dtype=torch.int32))
    assert allowed(bitmask[0]) == everything == allowed(bitmask[2])  # ended; unknown key
    first = allowed(bitmask[1])  # key 2 has taken nothing: "yes" or "no" starts
    assert yes[0] in first and eos not in first and len(first) < 10
    assert plain._accept([1], [yes[0]]) == []  # an ended grammar takes nothing more
    plain._free([2])
    assert plain._accept([2], [yes[0]]) == [] and 2 not in plain.grammars
    assert plain._accept([3], [eos]) == []  # never built
    # Every key live, one backend: the one-call path (no per-row loop), same answers.
    for key in (4, 5):
        plain._build(key, "xgrammar", spec, [eos], None)
    assert plain._plain_rows([4, 5]) is not None and plain._plain_rows([4, 1]) is None
    bitmask = torch.zeros(2, words, dtype=torch.int32)
    plain._fill_rows([4, 5], bitmask)
    assert allowed(bitmask[0]) == allowed(bitmask[1]) == first
    assert plain._accept([4, 5], [yes[0], eos]) == [(5, False)]  # eos cannot start a choice
    assert plain._accept([4] * (len(yes) - 1) + [4], yes[1:] + [eos]) == [(4, True)]

    # Qwen3's tags are not single tokens of this tokenizer: use ids the gate is told of.
    gated = server(reasoning_parser="qwen3")
    gated._build(1, "xgrammar", spec, [eos], np.array([1, 2], np.int32))
    gate = gated.gate
    gate.start_id, gate.end_id, gate.starts_in_reasoning = 11, 12, False
    for key, state in ((2, "undecided"), (3, "reasoning")):
        gated._build(key, "xgrammar", spec, [eos], np.array([1, 2], np.int32))
        gated.gate_state[key] = state
    bitmask = torch.zeros(3, words, dtype=torch.int32)
    gated._fill_rows([1, 2, 3], bitmask)
    assert 11 in allowed(bitmask[1]) and allowed(bitmask[1]) - {11} == allowed(bitmask[0])
    assert allowed(bitmask[2]) == everything
    # Reasoning, then the end tag (not the grammar's), then "yes" under the grammar.
    assert gated._accept([3, 3, 3] + [3] * len(yes) + [3], [40, 41, 12] + yes + [eos]) == [
        (3, True)]
    assert gated._accept([2], [yes[0]]) == []  # undecided: its first token is the grammar's
    assert 2 not in gated.gate_state
    gated._fill_rows([2], bitmask[:1])
    after_first = allowed(bitmask[0])
    assert (yes[1] if len(yes) > 1 else eos) in after_first and 11 not in after_first


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
def test_the_process_draws_the_same_tokens_as_the_helper_thread(backend):
    """ember.bench.grammar_host's process variant against its deferred one: tokens drawn from
    each step's masks with one seed, so equal masks give equal outputs (and equal counts)."""
    import argparse

    from ember.bench.grammar_host import run_variant
    from ember.default_model import default_model_path
    from ember.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(default_model_path())
    ns = argparse.Namespace(num_requests=12, max_tokens=40, vocab_size=len(tokenizer), seed=1,
                            tokenizer=None, forward_ms=0.5, spin_ms=1.0)
    deferred = run_variant(ns, tokenizer, backend, False, deferred=True)
    process = run_variant(ns, tokenizer, backend, False, process=True)
    for key in ("steps", "tokens", "outputs_valid_json"):
        assert process[key] == deferred[key], key
    assert process["outputs_valid_json"] > 0


def test_a_step_naming_a_key_still_building_waits_for_its_build():
    """The engine schedules a request at once when its grammar was built before, so a fill can
    reach the process while its build still runs there: the fill waits for it (its row is the
    grammar's, not one that allows every token)."""
    import functools
    import threading
    import time

    import numpy as np
    import torch

    from ember.default_model import default_model_path
    from ember.structured_output.config import StructuredOutputsConfig
    from ember.structured_output.grammar_server import _GrammarServer
    from ember.structured_output.interface import GrammarSpec
    from ember.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(default_model_path())
    eos = tokenizer.eos_token_id
    sent = []

    class Pipe:
        send = staticmethod(sent.append)

    server = _GrammarServer(Pipe(), StructuredOutputsConfig.of({"backend": "xgrammar"}),
                            functools.partial(load_tokenizer, default_model_path()),
                            len(tokenizer), eos + 1)
    server.pool.shutdown()
    words = (len(tokenizer) + 31) // 32
    server.buffers[0] = torch.zeros(words, dtype=torch.int32)
    spec = GrammarSpec.of(StructuredOutputsParams(choice=["yes", "no"]))
    server.building.add(5)  # as the "add" message does

    def build_later():
        time.sleep(0.3)
        server._build(5, "xgrammar", spec, [eos], None)

    builder = threading.Thread(target=build_later)
    builder.start()
    server._fill(0, [], [], [5], 0, (1, words))
    builder.join()
    assert [m[0] for m in sent] == ["built", "filled"]
    bits = np.unpackbits(server.buffers[0].numpy().view(np.uint8), bitorder="little")
    first = set(np.flatnonzero(bits).tolist())
    assert tokenizer.encode("yes", add_special_tokens=False)[0] in first and len(first) < 10


@pytest.mark.parametrize("process", ["0", "1"])
def test_a_grammar_built_before_is_scheduled_at_once(monkeypatch, process):
    """A request whose grammar was built before (with the grammar process: the same backend,
    spec and stop ids; on the engine's threads: the spec compiled) goes to the scheduler's
    queue as it is added, not after its build is answered (a batch of cached grammars would
    otherwise be admitted in waves); its tokens are those of the first batch."""
    monkeypatch.setenv("EMBER_GRAMMAR_PROCESS", process)
    llm = LLM(max_model_len=256)
    params = [SamplingParams(temperature=0.0, max_tokens=30,
                             structured_outputs=StructuredOutputsParams(json=SCHEMA)),
              SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=(
                  StructuredOutputsParams(choice=["Paris", "London", "Berlin"])))]
    first = llm.generate(PROMPTS[:2], params, use_tqdm=False)
    engine = llm.llm_engine
    scheduler = engine.engine_core.scheduler
    for i, (prompt, p) in enumerate(zip(PROMPTS[:2], params)):
        engine.add_request(f"again-{i}", prompt, p)
    assert not scheduler.compiling and len(scheduler.waiting) == 2
    outs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out
    assert [list(outs[f"again-{i}"].outputs[0].token_ids) for i in range(2)] == [
        list(o.outputs[0].token_ids) for o in first]
    json.loads(outs["again-0"].outputs[0].text)
    # A new spec still waits for its build.
    engine.add_request("new", PROMPTS[0], SamplingParams(
        max_tokens=4, structured_outputs=StructuredOutputsParams(regex="[a-z]+")))
    assert len(scheduler.compiling) == 1
    while engine.has_unfinished_requests():
        engine.step()
    assert_all_blocks_free(llm)
    llm.shutdown()


@pytest.mark.parametrize("process", ["0", "1"])
def test_a_build_failing_after_one_that_worked_ends_its_request(monkeypatch, process):
    """A request scheduled at once (its grammar built before) whose build fails after all is
    aborted, with an error logged, and the engine serves the others."""
    from ember.registry import GrammarBackendRegistry, isolated

    monkeypatch.setenv("EMBER_GRAMMAR_PROCESS", process)
    with isolated():
        GrammarBackendRegistry.register_grammar_backend("second_fails", SecondBuildFailsBackend)
        llm = LLM(max_model_len=128, structured_outputs_config={"backend": "second_fails"})
        params = SamplingParams(temperature=0.0, max_tokens=6,
                                structured_outputs=StructuredOutputsParams(regex="[a-z]+"))
        first = llm.generate(["a"], params, use_tqdm=False)[0].outputs[0]
        assert first.finish_reason != "abort" and first.token_ids
        outs = llm.generate(["b", "c"], [params, SamplingParams(max_tokens=5)], use_tqdm=False)
        assert outs[0].outputs[0].finish_reason == "abort"
        assert len(outs[1].outputs[0].token_ids) == 5
        assert_all_blocks_free(llm)
        llm.shutdown()
