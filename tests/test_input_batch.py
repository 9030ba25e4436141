"""The flat batch the model runner builds: the pure-decode fast path gives exactly the arrays
(values and dtypes) of the general path, placeholders included, and mixed steps take the general
path with decodes first."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest

from ember.sampling_params import SamplingParams
from ember.worker import input_batch
from ember.worker.input_batch import PLACEHOLDER, BlockTableRows, CachedRequestState

BLOCK = 4


def _decoding_states(seed: int, n: int):
    rng = random.Random(seed)
    states, tables = {}, BlockTableRows(num_rows=4, width=2)  # small: rows and width grow
    for i in range(n):
        prompt = [rng.randrange(3, 100) for _ in range(rng.randrange(1, 30))]
        outputs = [rng.randrange(3, 100) for _ in range(rng.randrange(0, 12))]
        if outputs and rng.random() < 0.5:
            outputs[-1] = PLACEHOLDER  # its token is still being sampled by the step in flight
        num_tokens = len(prompt) + len(outputs)
        req_id = f"r{i}"
        states[req_id] = CachedRequestState(req_id, prompt, outputs, SamplingParams(),
                                            num_tokens - 1)
        num_blocks = -(-num_tokens // BLOCK)
        tables.set(req_id, rng.sample(range(1000), num_blocks))
    return states, tables


def _assert_same(a, b) -> None:
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, np.ndarray):
            assert x.dtype == y.dtype, f.name
            np.testing.assert_array_equal(x, y, err_msg=f.name)
        else:
            assert x == y, f.name


@pytest.mark.parametrize("seed,n", [(0, 1), (1, 2), (2, 7), (3, 64)])
def test_decode_fast_path_equals_general_path(seed, n):
    states, tables = _decoding_states(seed, n)
    order = list(states)
    random.Random(seed).shuffle(order)
    scheduled = {r: 1 for r in order}
    fast = input_batch.build_flat_batch(states, scheduled, BLOCK, tables)
    general = input_batch._mixed_batch(fast.req_ids, [states[r] for r in fast.req_ids],
                                       [1] * n, BLOCK, tables)
    _assert_same(fast, general)
    assert fast.num_decode_tokens == n and fast.sample_rows == list(range(n))


def test_mixed_step_puts_decodes_first_and_samples_only_caught_up_rows():
    states, tables = _decoding_states(5, 3)
    prompt = list(range(3, 23))  # 20 tokens, 8 computed: a chunk of 5 that does not finish
    states["p"] = CachedRequestState("p", prompt, [], SamplingParams(), 8)
    tables.set("p", [900, 901, 902, 903, 904])
    batch = input_batch.build_flat_batch(states, {"p": 5, "r0": 1, "r1": 1, "r2": 1}, BLOCK,
                                         tables)
    assert batch.req_ids == ["r0", "r1", "r2", "p"]
    assert batch.num_decode_tokens == 3 and batch.sample_rows == [0, 1, 2]
    np.testing.assert_array_equal(batch.positions[3:], np.arange(8, 13))
    np.testing.assert_array_equal(batch.input_ids[3:], prompt[8:13])
    np.testing.assert_array_equal(batch.slot_mapping[3:], [902 * 4, 902 * 4 + 1, 902 * 4 + 2,
                                                           902 * 4 + 3, 903 * 4])
