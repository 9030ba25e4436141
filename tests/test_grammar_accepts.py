"""Deferred accepts (async scheduling): the grammars take a step's tokens on the bitmask helper
thread, in one batched backend call (StructuredOutputBackend.accept_tokens), and a grammar
found complete or refusing its token is reported for the engine core to end. The results must
be those of accepting each token as it is folded in: the same bitmasks, the same endings."""

from __future__ import annotations

import functools

import pytest

from ember.core.request import Request, RequestStatus
from ember.sampling_params import SamplingParams, StructuredOutputsParams
from ember.structured_output.config import StructuredOutputsConfig
from ember.structured_output.manager import StructuredOutputManager


@functools.cache
def _tokenizer():
    from ember.default_model import default_model_path
    from ember.tokenizer import load_tokenizer

    return load_tokenizer(default_model_path())


def _manager(deferred: bool) -> StructuredOutputManager:
    tok = _tokenizer()
    manager = StructuredOutputManager(StructuredOutputsConfig(backend="xgrammar"), lambda: tok,
                                      len(tok), [tok.eos_token_id])
    manager.defer_accepts = deferred
    return manager


def _request(i: int, so: StructuredOutputsParams) -> Request:
    eos = _tokenizer().eos_token_id
    return Request(str(i), [1, 2, 3], SamplingParams(temperature=0, max_tokens=64,
                                                     structured_outputs=so), {eos}, 16)


def _built(manager: StructuredOutputManager, requests: list[Request]) -> None:
    for request in requests:
        manager.add(request)
    while not all(manager.ready(r) for r in requests):
        manager.wait(0.01)


def test_xgrammar_batched_accept_equals_one_by_one():
    """xgrammar's batched accept (one call, the GIL released) gives each grammar the state and
    verdict of its own accept_token."""
    import torch

    from ember.structured_output.xgrammar_backend import XgrammarBackend

    tok = _tokenizer()
    backend = XgrammarBackend(tok, len(tok), StructuredOutputsConfig())
    compiled = backend.compile(_spec(regex=r"(ab|cd)+x"))
    texts = ["ab", "cd", "x", "q"]
    tokens = [tok.encode(t, add_special_tokens=False)[0] for t in texts]
    step = [tokens[i % len(tokens)] for i in range(19)]
    batched = [backend.new_grammar(compiled, []) for _ in step]
    single = [backend.new_grammar(compiled, []) for _ in step]
    got = backend.accept_tokens(batched, step)
    assert got == [g.accept_token(t) for g, t in zip(single, step)]
    # "x" only after a pair, "q" never.
    assert got.count(False) == sum(t in (tokens[2], tokens[3]) for t in step) > 0
    masks = [torch.zeros(len(step), (len(tok) + 31) // 32, dtype=torch.int32) for _ in range(2)]
    for grammars, mask in zip((batched, single), masks):
        for row, grammar in enumerate(grammars):
            grammar.fill_bitmask(mask, row)
    assert torch.equal(masks[0], masks[1])


def test_xgrammar_advance_equals_the_contracts_default():
    """xgrammar's advance (the native batch accept searched for refusals, is_terminated asked
    only of rows that took a stop token) reports exactly the rows the contract's default does
    (accept_tokens, then is_terminated of every row that took its token), step after step, with
    refusals, completions and rows that stay open, and leaves each grammar in the same state."""
    import random

    import torch

    from ember.structured_output.interface import StructuredOutputBackend
    from ember.structured_output.xgrammar_backend import XgrammarBackend

    tok = _tokenizer()
    backend = XgrammarBackend(tok, len(tok), StructuredOutputsConfig())
    compiled = backend.compile(_spec(regex=r"(ab|cd)+x?"))
    ab, cd, x, q = (tok.encode(t, add_special_tokens=False)[0] for t in ("ab", "cd", "x", "q"))
    eos = tok.eos_token_id
    rng = random.Random(0)
    rows = 40
    fast = [backend.new_grammar(compiled, [eos]) for _ in range(rows)]
    slow = [backend.new_grammar(compiled, [eos]) for _ in range(rows)]
    open_rows = list(range(rows))
    seen_ends = set()
    for _ in range(12):
        if not open_rows:
            break
        step = [rng.choice([ab, cd, ab, cd, x, q, eos]) for _ in open_rows]
        got = backend.advance([fast[i] for i in open_rows], step)
        want = StructuredOutputBackend.advance(backend, [slow[i] for i in open_rows], step)
        assert got == want
        seen_ends.update(ok for _, ok in got)
        ended = {i for i, _ in got}
        open_rows = [r for j, r in enumerate(open_rows) if j not in ended]
        masks = [torch.zeros(len(open_rows), (len(tok) + 31) // 32, dtype=torch.int32)
                 for _ in range(2)]
        for grammars, mask in zip((fast, slow), masks):
            for j, r in enumerate(open_rows):
                grammars[r].fill_bitmask(mask, j)
        assert torch.equal(masks[0], masks[1])
    assert seen_ends == {True, False}  # both kinds of ending happened


def _spec(**kwargs):
    from ember.structured_output.interface import GrammarSpec

    return GrammarSpec.of(StructuredOutputsParams(**kwargs))


def test_deferred_accepts_fill_the_same_bitmask_and_report_endings():
    """Tokens recorded by accept() and taken by the next fill: the bitmask of accepting each at
    once; a grammar completed by its token (eos) is reported "stop", one handed a token its
    mask did not allow "abort", and neither gets a row filled."""
    tok = _tokenizer()
    ab, cd, x, q = (tok.encode(t, add_special_tokens=False)[0] for t in ("ab", "cd", "x", "q"))
    eos = tok.eos_token_id
    so = StructuredOutputsParams(regex=r"(ab|cd)+x")
    # Request 0 stays open; 1 completes with eos at the third step; 2 is handed "q".
    steps = [[ab, ab, ab], [cd, x, q], [ab, eos, None]]
    runs = {}
    for deferred in (False, True):
        manager = _manager(deferred)
        requests = [_request(i, so) for i in range(3)]
        _built(manager, requests)
        ended = []
        for tokens in steps:
            for request, token in zip(requests, tokens):
                if request.status >= RequestStatus.FINISHED_STOPPED:
                    continue
                request.append_output_token(token)
                if manager.accept(request, token):
                    ended.append((request.request_id, request.status))
            bitmask = manager.fill(requests)
            for request, status in manager.take_finished():  # as the engine core ends them
                request.status = status
                ended.append((request.request_id, status))
        runs[deferred] = (bitmask, ended)
        manager.shutdown()
    (eager_mask, eager_ended), (deferred_mask, deferred_ended) = runs[False], runs[True]
    assert sorted(eager_ended) == sorted(deferred_ended) == [
        ("1", RequestStatus.FINISHED_STOPPED), ("2", RequestStatus.FINISHED_ABORTED)]
    assert eager_mask.req_ids == ["0"]
    # The deferred fill found request 1 complete as it filled: its row is left unfilled
    # (every token allowed: its sample is dropped).
    assert deferred_mask.req_ids == ["0", "1"]
    assert deferred_mask.bitmask[0].tolist() == eager_mask.bitmask[0].tolist()
    assert set(deferred_mask.bitmask[1].tolist()) == {-1}


@pytest.mark.parametrize("behind", [2, 3])
def test_deferred_accepts_replay_several_tokens(behind):
    """A request several tokens behind (it sat out steps) takes them one by one in the fill."""
    tok = _tokenizer()
    text = '{"a": [1, 2, 3]}'
    ids = tok.encode(text, add_special_tokens=False)
    masks = []
    for deferred in (False, True):
        manager = _manager(deferred)
        request = _request(0, StructuredOutputsParams(json_object=True))
        _built(manager, [request])
        for token in ids[:behind]:
            request.append_output_token(token)
            manager.accept(request, token)
        masks.append(manager.fill([request]).bitmask.clone())
        assert manager.take_finished() == []
        manager.shutdown()
    assert masks[0].tolist() == masks[1].tolist()
