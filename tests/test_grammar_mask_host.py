"""GrammarMasks.masked_greedy_on_host: greedy ids under a step's grammar bitmask on the host,
by an argmax first and a masked argmax again only where the grammar refuses the first. It must
equal masking every constrained row and taking the argmax, for rows without a grammar, rows
whose argmax is allowed or not, ties, bitmasks narrower than the logits, and bfloat16 logits."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from ember.core.scheduler_output import GrammarBitmask
from ember.platforms.cpu import CpuPlatform
from ember.structured_output.bitmask import apply_token_bitmask_
from ember.worker.grammar_mask import GrammarMasks, bitmask_rows


def _reference(logits, rows, grammar):
    masked = logits.float().clone()
    mask_rows = bitmask_rows(rows, grammar)
    words = grammar.bitmask.numpy()
    for i, j in enumerate(mask_rows):
        if j >= 0:
            one = masked[i:i + 1]
            apply_token_bitmask_(one, torch.from_numpy(words[j:j + 1].copy()))
    return masked.argmax(dim=-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", range(4))
def test_masked_greedy_on_host_equals_masking_every_row(dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    num_rows, vocab, mask_vocab = 9, 300, 260  # the bitmask ends before the logits do
    logits = torch.randn(num_rows, vocab, generator=gen).to(dtype)
    logits[0, 5] = logits[0, 7] = 50.0  # a tie: the first of them is the argmax
    logits[1, 280] = 50.0  # its argmax lies past the bitmask's end: never allowed
    rows = [SimpleNamespace(req_id=f"r{i}") for i in range(num_rows)]
    constrained = ["r0", "r1", "r2", "r4", "r5", "r7", "r8"]  # r3 and r6 have no grammar
    words = (mask_vocab + 31) // 32
    rng = np.random.default_rng(seed)
    bits = rng.random((len(constrained), words * 32)) < 0.3
    bits[:, mask_vocab:] = False
    argmax = logits.float().argmax(dim=-1)
    bits[constrained.index("r2"), int(argmax[2])] = True  # allowed argmax: first pass only
    bits[constrained.index("r4"), int(argmax[4])] = False  # refused: masked again
    bits[constrained.index("r0"), 5] = False  # the tie's first token refused, the second kept
    bits[constrained.index("r0"), 7] = True
    packed = np.packbits(bits, axis=1, bitorder="little").view(np.int32)
    order = rng.permutation(len(constrained))  # the scheduler's row order is not the batch's
    grammar = GrammarBitmask([constrained[i] for i in order],
                             torch.from_numpy(packed[order].copy()))
    masks = GrammarMasks(CpuPlatform(), torch.device("cpu"))
    expected = _reference(logits, rows, grammar)
    got = masks.masked_greedy_on_host(logits.clone(), rows, grammar)
    assert got.tolist() == expected.tolist()
    assert got[0] == 7 and got[3] == argmax[3] and got[6] == argmax[6]


def test_bitmask_rows_in_order_and_not():
    """Every row under a grammar in the scheduler's order maps row i to bitmask row i (the
    masked-argmax kernel then reads no row map); any other layout goes through the map."""
    from ember.worker.grammar_mask import rows_in_order

    rows = [SimpleNamespace(req_id=f"r{i}") for i in range(4)]
    bits = torch.zeros(4, 2, dtype=torch.int32)
    in_order = GrammarBitmask(["r0", "r1", "r2", "r3"], bits)
    assert rows_in_order(rows, in_order)
    assert bitmask_rows(rows, in_order).tolist() == [0, 1, 2, 3]
    swapped = GrammarBitmask(["r1", "r0", "r2", "r3"], bits)
    assert not rows_in_order(rows, swapped)
    assert bitmask_rows(rows, swapped).tolist() == [1, 0, 2, 3]
    fewer = GrammarBitmask(["r0", "r2"], bits[:2])
    assert not rows_in_order(rows, fewer)
    assert bitmask_rows(rows, fewer).tolist() == [0, -1, 1, -1]
