"""FlashInfer backend planning, on CPU with a fake ``flashinfer`` module (no GPU, no FlashInfer).

Checks the per-step plan bookkeeping of ``ember/attention_backends/flashinfer_backend.py``: layers
with the same attention settings (sliding window, logits soft cap, scale) share one plan per step
and wrapper kind; layers with other settings get their own plan on their own wrapper objects (all
sharing one scratch workspace), and each layer's output comes from its own plan; a new step plans
again. The
fake wrappers record their constructor and ``plan`` arguments and ``run`` fills ``out`` with a
value derived from the plan that is live on that wrapper, so a layer that ran on someone else's
plan shows up in its output. The Triton KV store is replaced by a plain torch one.
"""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest
import torch

import ember.attention_backends.flashinfer_backend as fb
from ember.attention_backends.base import AttentionMetadata
from ember.kernels.buffers import release_scratch, scratch_buffers
from ember.layers.attention import Attention, ForwardContext

NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 4, 2, 8, 4
SCALE = HEAD_SIZE**-0.5
# (context already cached, new tokens this step); decodes lead, as the model runner orders them.
MIXED = [(9, 1), (3, 1), (0, 6), (5, 3)]
MIXED_2 = [(12, 1), (0, 2), (2, 5)]  # the next step: other lengths, other decode/prefill split
# run() fills out with BASE[kind] + window_left of the plan live on the wrapper.
BASE = {"decode": 100.0, "prefill": 200.0}


class _FakeWrapper:
    kind = ""

    def __init__(self, workspace, layout, **kwargs):
        self.workspace, self.layout, self.kwargs = workspace, layout, kwargs
        self.plans: list[tuple[tuple, dict]] = []  # (args, kwargs) of every plan() call
        self.runs: list[int] = []  # index of the plan each run() used

    def plan(self, *args, **kwargs):
        self.plans.append((args, kwargs))

    def run(self, q, caches, out=None):
        assert self.plans, "run() before plan()"
        assert out is not None and out.shape == q.shape
        assert isinstance(caches, tuple) and len(caches) == 2
        self.runs.append(len(self.plans) - 1)
        out.fill_(BASE[self.kind] + self.plans[-1][1]["window_left"])
        return out


@pytest.fixture
def fake(monkeypatch):
    """A fake flashinfer module (its wrappers listed in ``created``), fresh wrapper/workspace
    caches, a small workspace, and a torch KV store in place of the Triton kernel."""
    mod = types.ModuleType("flashinfer")
    mod.created = []

    class Decode(_FakeWrapper):
        kind = "decode"

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            mod.created.append(self)

    class Prefill(_FakeWrapper):
        kind = "prefill"

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            mod.created.append(self)

    mod.BatchDecodeWithPagedKVCacheWrapper = Decode
    mod.BatchPrefillWithPagedKVCacheWrapper = Prefill
    monkeypatch.setitem(sys.modules, "flashinfer", mod)
    monkeypatch.setattr(fb.FlashInferBackend, "_wrappers", {})
    release_scratch(fb.FLOAT_WORKSPACE)  # a fresh (small) workspace, dropped again at the end
    monkeypatch.setattr(fb, "_WORKSPACE_BYTES", 64)

    def store_kv(key, value, kv_cache, slot_mapping):
        flat = kv_cache.view(2, -1, *kv_cache.shape[3:])
        slots = slot_mapping[: key.shape[0]].long()
        keep = slots >= 0
        flat[0, slots[keep]] = key[keep].to(flat.dtype)
        flat[1, slots[keep]] = value[keep].to(flat.dtype)

    # forward does `from ember.kernels.store_kv import store_kv`; a stand-in module in
    # sys.modules answers that import without importing triton.
    ops = types.ModuleType("ember.kernels.store_kv")
    ops.store_kv = store_kv
    monkeypatch.setitem(sys.modules, "ember.kernels.store_kv", ops)
    yield mod
    release_scratch(fb.FLOAT_WORKSPACE)


def _metadata(shape):
    """The step's metadata as ModelRunner._metadata builds it, through the backend's builder.
    Blocks are handed out back to front so page indices differ from row-major positions."""
    seq_lens = np.array([c + q for c, q in shape], dtype=np.int32)
    query_lens = np.array([q for _, q in shape], dtype=np.int32)
    qsl = np.zeros(len(shape) + 1, dtype=np.int32)
    np.cumsum(query_lens, out=qsl[1:])
    need = [-(-int(s) // BLOCK_SIZE) for s in seq_lens]
    num_blocks = sum(need) + 2
    free = list(range(num_blocks))
    table = np.zeros((len(shape), max(need) + 1), dtype=np.int32)
    slots = []
    for r, (ctx, q_len) in enumerate(shape):
        blocks = [free.pop() for _ in range(need[r])]
        table[r, : need[r]] = blocks
        slots += [blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(ctx, ctx + q_len)]
    num_decodes = next((i for i, (c, q) in enumerate(shape) if q != 1 or c == 0), len(shape))
    md = AttentionMetadata(
        num_actual_tokens=int(qsl[-1]),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc=torch.from_numpy(qsl),
        seq_lens=torch.from_numpy(seq_lens),
        block_table=torch.from_numpy(table),
        max_query_len=int(query_lens.max()),
        max_seq_len=int(seq_lens.max()),
        query_start_loc_cpu=qsl.tolist(),
        seq_lens_cpu=seq_lens.tolist(),
        num_decode_tokens=num_decodes,
    )
    return fb.FlashInferBackend.build_metadata(md), num_blocks


def _layers(settings):
    """One Attention layer per (sliding_window, logits_soft_cap, scale), as models build them."""
    return [
        Attention(NUM_HEADS, HEAD_SIZE, scale, NUM_KV_HEADS, i, fb.FlashInferBackend,
                  sliding_window=window, logits_soft_cap=cap)
        for i, (window, cap, scale) in enumerate(settings)
    ]  # fmt: skip


def _step(layers, shape, caches=None):
    """Run every layer over one step; returns the metadata, the caches and each layer's output."""
    md, num_blocks = _metadata(shape)
    if caches is None:
        caches = [torch.zeros(2, num_blocks + 8, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE)
                  for _ in layers]  # fmt: skip
    ctx = ForwardContext(md, caches)
    n = md.num_actual_tokens
    gen = torch.Generator().manual_seed(0)
    outs = []
    for layer in layers:
        q = torch.randn(n, NUM_HEADS * HEAD_SIZE, generator=gen)
        k = torch.randn(n, NUM_KV_HEADS * HEAD_SIZE, generator=gen)
        v = torch.randn(n, NUM_KV_HEADS * HEAD_SIZE, generator=gen)
        outs.append(layer(q, k, v, ctx))
    return md, caches, outs


def _window_left(window):
    return window - 1 if window else -1


def _wrappers(fake, kind):
    return [w for w in fake.created if w.kind == kind]


def _assert_output(out, md, window):
    nd, n = md.num_decode_tokens, md.num_actual_tokens
    assert out.shape == (n, NUM_HEADS * HEAD_SIZE)
    wl = _window_left(window)
    # Plain comparisons: the values are exact, and torch.testing's first call costs a second.
    assert set(out[:nd].unique().tolist()) == ({BASE["decode"] + wl} if nd else set())
    assert set(out[nd:].unique().tolist()) == ({BASE["prefill"] + wl} if n > nd else set())


def _expected_tables(md, rows):
    """(kv indptr, page indices, last page lengths) of `rows`, straight from the definition."""
    indptr, indices, last = [0], [], []
    for r in rows:
        seq = md.seq_lens_cpu[r]
        pages = -(-seq // BLOCK_SIZE)
        indptr.append(indptr[-1] + pages)
        indices += md.block_table[r, :pages].tolist()
        last.append(seq - (pages - 1) * BLOCK_SIZE)
    return indptr, indices, last


def _assert_plan_args(wrapper, plan_idx, md, window, cap=None, scale=SCALE):
    args, kwargs = wrapper.plans[plan_idx]
    nd, nr = md.num_decode_tokens, md.num_reqs
    assert kwargs["window_left"] == _window_left(window)
    assert kwargs["logits_soft_cap"] == cap
    assert kwargs["sm_scale"] == scale
    assert kwargs["q_data_type"] == torch.float32 and kwargs["kv_data_type"] == torch.float32
    if wrapper.kind == "decode":
        tables, geometry = args[:3], args[3:]
        assert kwargs["pos_encoding_mode"] == "NONE"
        expected = _expected_tables(md, range(0, nd))
    else:
        qsl = md.query_start_loc_cpu
        assert args[0].tolist() == [q - qsl[nd] for q in qsl[nd:]]
        tables, geometry = args[1:4], args[4:]
        assert kwargs["causal"] is True
        expected = _expected_tables(md, range(nd, nr))
    assert [t.tolist() for t in tables] == [list(e) for e in expected]
    assert geometry == (NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE)


def test_same_settings_share_one_plan_per_step(fake):
    layers = _layers([(None, None, SCALE)] * 3)
    md, caches, outs = _step(layers, MIXED)
    assert 0 < md.num_decode_tokens < md.num_actual_tokens  # both wrapper kinds are needed
    for kind in ("decode", "prefill"):
        (wrapper,) = _wrappers(fake, kind)  # one wrapper per kind ...
        assert len(wrapper.plans) == 1  # ... planned once for the step ...
        assert wrapper.runs == [0, 0, 0]  # ... and that plan serves every layer
        _assert_plan_args(wrapper, 0, md, None)
    (decode,) = _wrappers(fake, "decode")
    assert decode.layout == "NHD" and decode.kwargs == {"use_tensor_cores": False}  # group 2
    assert len(scratch_buffers(fb.FLOAT_WORKSPACE)) == 1
    for out in outs:
        _assert_output(out, md, None)
    # The KV store ran for every layer before attention.
    slots = md.slot_mapping.long()
    for cache in caches:
        assert cache.view(2, -1, NUM_KV_HEADS, HEAD_SIZE)[:, slots].abs().sum(-1).gt(0).all()


def test_sliding_and_full_layers_plan_separately(fake):
    # Interleaved like models that mix sliding and full attention: if both settings shared a
    # wrapper, layer 2 would run on the plan layer 1 left there.
    windows = [None, 5, None, 5]
    layers = _layers([(w, None, SCALE) for w in windows])
    md, _, outs = _step(layers, MIXED)
    assert 0 < md.num_decode_tokens < md.num_actual_tokens
    for kind in ("decode", "prefill"):
        wrappers = _wrappers(fake, kind)
        assert len(wrappers) == 2 and wrappers[0] is not wrappers[1]
        by_window = {w.plans[0][1]["window_left"]: w for w in wrappers}
        assert sorted(by_window) == [-1, 4]
        for window in (None, 5):
            wrapper = by_window[_window_left(window)]
            assert len(wrapper.plans) == 1  # one plan per settings group and step
            assert wrapper.runs == [0, 0]  # used by both layers of that group
            _assert_plan_args(wrapper, 0, md, window)
    # One float workspace for all: it is per-run scratch (each wrapper keeps its own plan).
    assert len(scratch_buffers(fb.FLOAT_WORKSPACE)) == 1
    assert len({w.workspace.data_ptr() for w in fake.created}) == 1
    for out, window in zip(outs, windows):  # every layer's output comes from its own plan
        _assert_output(out, md, window)


@pytest.mark.parametrize(
    "settings",
    [[(None, None, SCALE), (None, 30.0, SCALE)], [(None, None, SCALE), (None, None, 0.5)]],
    ids=["soft_cap", "scale"],
)
def test_soft_cap_and_scale_are_plan_settings(fake, settings):
    md, _, outs = _step(_layers(settings), MIXED)
    for kind in ("decode", "prefill"):
        wrappers = _wrappers(fake, kind)
        assert len(wrappers) == 2 and wrappers[0] is not wrappers[1]
        for wrapper, (window, cap, scale) in zip(wrappers, settings):
            assert len(wrapper.plans) == 1 and wrapper.runs == [0]
            _assert_plan_args(wrapper, 0, md, window, cap, scale)
    for out in outs:
        _assert_output(out, md, None)


def test_new_step_plans_again(fake):
    windows = [None, 5]
    layers = _layers([(w, None, SCALE) for w in windows])
    md1, caches, _ = _step(layers, MIXED)
    wrappers = list(fake.created)
    workspaces = dict(scratch_buffers(fb.FLOAT_WORKSPACE))
    assert len(wrappers) == 4 and all(len(w.plans) == 1 for w in wrappers)

    md2, _, outs = _step(layers, MIXED_2, caches)
    assert md2 is not md1 and md2.num_decode_tokens != md1.num_decode_tokens
    assert fake.created == wrappers  # the wrappers and workspaces are reused across steps ...
    assert scratch_buffers(fb.FLOAT_WORKSPACE) == workspaces
    for wrapper in wrappers:  # ... but every wrapper is planned again, for the new batch
        assert len(wrapper.plans) == 2 and wrapper.runs == [0, 1]
        window = 5 if wrapper.plans[1][1]["window_left"] == 4 else None
        _assert_plan_args(wrapper, 0, md1, window)
        _assert_plan_args(wrapper, 1, md2, window)
    for out, window in zip(outs, windows):
        _assert_output(out, md2, window)

    # A decode-only step plans (and runs) only the decode wrappers.
    md3, _, outs = _step(layers, [(4, 1), (7, 1)], caches)
    assert md3.num_decode_tokens == md3.num_actual_tokens == 2
    for wrapper in wrappers:
        assert len(wrapper.plans) == (3 if wrapper.kind == "decode" else 2)
    for out, window in zip(outs, windows):
        _assert_output(out, md3, window)
