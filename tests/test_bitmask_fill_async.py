"""The engine core fills a step's grammar bitmask on a helper thread (fill_async) while its
own thread goes on: the result must equal fill()'s for the same grammar states, through both
built-in backends. Until the fill is done the GIL's switch interval is short (the helper starts
its fill, and comes back from it, without waiting for the engine thread to block), and then it
is what it was again."""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
import pytest
import torch

from ember.bench.grammar_host import _manager, _requests
from ember.structured_output.manager import FILL_SWITCH_INTERVAL_S


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
def test_fill_async_equals_fill(backend):
    from ember.default_model import default_model_path
    from ember.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(default_model_path())
    manager = _manager(backend, tokenizer, len(tokenizer), model_width=False)
    requests = _requests(argparse.Namespace(max_tokens=64, num_requests=12),
                         tokenizer.eos_token_id)
    interval = sys.getswitchinterval()
    try:
        for request in requests:
            manager.add(request)
        while not all(manager.ready(r) for r in requests):
            manager.wait(0.01)
        seen_inside: list[float] = []  # the switch interval while a backend fills
        engine = manager._compiler.backends[backend]
        native_fill = engine.fill_bitmasks

        def watched_fill(*args):
            seen_inside.append(sys.getswitchinterval())
            native_fill(*args)

        engine.fill_bitmasks = watched_fill
        rng = np.random.default_rng(0)
        for _ in range(6):  # a few steps: each row advances by a token its mask allows
            sync = manager.fill(requests)
            pending = manager.fill_async(requests)
            got = pending.result()
            assert seen_inside[-1] <= FILL_SWITCH_INTERVAL_S  # during the helper's fill
            _wait_for_interval(interval)
            assert sys.getswitchinterval() == interval
            assert got.req_ids == sync.req_ids
            assert torch.equal(got.bitmask, sync.bitmask)
            words = sync.bitmask.numpy()
            for row, request in enumerate(requests):
                bits = np.unpackbits(words[row].view(np.uint8), bitorder="little")
                token = int(rng.choice(np.flatnonzero(bits[:len(tokenizer)])))
                request.append_output_token(token)
                manager.accept(request, token)
        # Two fills pending at once (a done callback may run after the next fill began): the
        # interval comes back to what it was only when both are done.
        first, second = manager.fill_async(requests), manager.fill_async(requests)
        assert torch.equal(first.result().bitmask, second.result().bitmask)
        _wait_for_interval(interval)
        assert sys.getswitchinterval() == interval
    finally:
        manager.shutdown()
        sys.setswitchinterval(interval)


def _wait_for_interval(interval: float) -> None:
    """The future's done callback, which restores the interval, runs just after its result is
    set: give it a moment."""
    deadline = time.monotonic() + 5
    while sys.getswitchinterval() != interval and time.monotonic() < deadline:
        time.sleep(0.001)


def test_fills_into_the_host_buffers_in_turn():
    """With use_host_buffers (the engine core gives page-locked ones on a GPU) each fill writes
    into the next of the buffers, in turn, growing one that is too small, and equals a fill into
    a fresh array, also where a buffer held a longer bitmask before."""
    from ember.default_model import default_model_path
    from ember.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(default_model_path())
    manager = _manager("xgrammar", tokenizer, len(tokenizer), model_width=False)
    requests = _requests(argparse.Namespace(max_tokens=64, num_requests=6),
                         tokenizer.eos_token_id)
    allocated: list[torch.Tensor] = []

    def allocate(numel: int) -> torch.Tensor:
        allocated.append(torch.full((numel,), 12345, dtype=torch.int32))  # not -1: no head start
        return allocated[-1]

    try:
        for request in requests:
            manager.add(request)
        while not all(manager.ready(r) for r in requests):
            manager.wait(0.01)
        want = manager.fill(requests)  # a fresh array
        want_few = manager.fill(requests[:2])
        manager.use_host_buffers(allocate, count=2)
        first = manager.fill(requests[:2])
        second = manager.fill_async(requests).result()
        third = manager.fill(requests)  # the first buffer again, grown: 2 rows -> 6
        fourth = manager.fill(requests[:2])  # the second buffer, 6 rows of old bits in it
        for got, expect, buffer in ((first, want_few, allocated[0]), (second, want, allocated[1]),
                                    (third, want, allocated[2]), (fourth, want_few, allocated[1])):
            assert got.bitmask.data_ptr() == buffer.data_ptr()
            assert got.req_ids == expect.req_ids and torch.equal(got.bitmask, expect.bitmask)
        assert len(allocated) == 3
    finally:
        manager.shutdown()
