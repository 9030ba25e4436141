"""Conformance check of an attention backend against the SDPA reference, over a grid of shapes.

The kit plays the model runner: it allocates paged KV caches (a tiny block allocator, with prefix
sharing), builds the AttentionMetadata of every step exactly as base.py specifies (decode requests
first, `num_decode_tokens` of them), calls the backend's `build_metadata` once per step and its
impl for two layers sharing that metadata, and compares outputs (and the cached K/V, when the
backend keeps the standard cache layout) with the reference run through the same steps.
Caches start filled with random garbage, so a backend that reads unwritten or masked slots fails.

Scenarios (each a sequence of steps of (request, new tokens)): prefill, decode, chunked prefill,
prefix hits (a request whose first blocks are another's), a mixed batch, and, for graph-safe
backends, padded decode batches built as the CUDA-graph runner builds them: each padding row is a
request of its own with one query token, slot -1 (write nothing) and seq_len 0 (no keys), counted
in `num_decode_tokens` but not in `num_actual_tokens`. Every case also runs the step the engine's
memory profiling runs: every slot -1 with `num_actual_tokens` counting all tokens, which must
leave the cache untouched.

Before any case the kit checks the contract's shape: the backend overrides `impl_cls()`, the impl
overrides `forward`, and `forward` takes q `[T, num_heads, head_size]` (k, v `[T, num_kv_heads,
head_size]`) and returns `[T, num_heads * head_size]` in q's dtype, without changing q.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from ember.attention_backends.base import AttentionBackend, AttentionImpl, AttentionMetadata
from ember.registry.capabilities import canonical_dtype

_TOL = {"float32": (2e-4, 2e-4), "float16": (3e-3, 3e-3), "bfloat16": (2.5e-2, 2.5e-2)}


@dataclass
class Scenario:
    """Steps of (request id, number of new tokens); `shared` maps a request to the request and
    number of full blocks whose cached K/V it starts with (a prefix-cache hit)."""

    name: str
    steps: list[list[tuple[int, int]]]
    shared: dict[int, tuple[int, int]] = field(default_factory=dict)
    pad_to: int | None = None  # pad decode steps to this many rows, as the CUDA-graph runner does


def default_scenarios(block_size: int) -> list[Scenario]:
    bs = block_size
    return [
        Scenario("prefill", [[(0, 7), (1, 2 * bs + 3), (2, 1)]]),
        Scenario("decode", [[(0, 5), (1, bs + 1), (2, bs)]] + [[(0, 1), (1, 1), (2, 1)]] * 3),
        Scenario("chunked_prefill", [[(0, bs + 3)], [(0, bs), (1, 4)], [(0, 5), (1, 1)],
                                     [(0, 1), (1, 2 * bs)]]),
        Scenario("prefix_hit", [[(0, 2 * bs + 3)], [(1, 5), (2, 1)], [(0, 1), (1, 1), (2, 1)]],
                 shared={1: (0, 2), 2: (0, 1)}),
        Scenario("mixed", [[(0, 9), (1, 3)], [(0, 1), (1, 1), (2, 6), (3, bs + 2)],
                           [(0, 1), (2, 1), (3, 1), (1, 5)]]),
        Scenario("padded_decode", [[(0, 6), (1, bs + 2)], [(0, 1), (1, 1)], [(0, 1), (1, 1)]],
                 pad_to=4),
    ]


@dataclass
class AttentionGrid:
    """The shapes to run. heads: (num_heads, num_kv_heads) pairs; GQA when they differ."""

    head_sizes: tuple[int, ...] = (64,)
    heads: tuple[tuple[int, int], ...] = ((4, 4), (4, 2), (8, 1))
    block_sizes: tuple[int, ...] = (16,)
    sliding_windows: tuple[int | None, ...] = (None,)
    soft_caps: tuple[float | None, ...] = (None,)
    scenarios: tuple[str, ...] | None = None  # None: every default scenario


class _Allocator:
    """Gives out blocks and remembers each request's block list and computed tokens."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.next_block = 1  # block 0 is left unused: padded block-table entries point there
        self.blocks: dict[int, list[int]] = {}
        self.computed: dict[int, int] = {}

    def start(self, req: int, shared: tuple[int, int] | None) -> None:
        if shared is None:
            self.blocks[req], self.computed[req] = [], 0
        else:
            src, n = shared
            self.blocks[req] = list(self.blocks[src][:n])
            self.computed[req] = n * self.block_size

    def grow(self, req: int, total_tokens: int) -> None:
        need = -(-total_tokens // self.block_size)
        while len(self.blocks[req]) < need:
            self.blocks[req].append(self.next_block)
            self.next_block += 1


def build_step_metadata(
    alloc: _Allocator, step: list[tuple[int, int]], device: torch.device, pad_to: int | None
) -> tuple[AttentionMetadata, list[tuple[int, int]]]:
    """The metadata of one step, and the step's (request, tokens) in batch order (decodes
    first, as the runner orders them)."""
    for req, _ in step:
        if req not in alloc.blocks:
            raise ValueError(f"request {req} was not started")
    order = sorted(step, key=lambda rn: not (rn[1] == 1 and alloc.computed[rn[0]] > 0))
    num_decode = 0
    for req, n in order:
        if n == 1 and alloc.computed[req] > 0:
            num_decode += 1
        else:
            break
    bs = alloc.block_size
    slots: list[int] = []
    qsl, seq_lens, tables = [0], [], []
    for req, n in order:
        start = alloc.computed[req]
        alloc.grow(req, start + n)
        table = alloc.blocks[req]
        slots += [table[p // bs] * bs + p % bs for p in range(start, start + n)]
        qsl.append(qsl[-1] + n)
        seq_lens.append(start + n)
        tables.append(table)
        alloc.computed[req] = start + n
    num_tokens = len(slots)
    if pad_to and num_decode == len(order) and num_tokens < pad_to:
        # As the CUDA-graph runner pads a decode batch: one request per padding row, with one
        # query token, no KV write (slot -1) and no keys (seq_len 0); block-table rows of block 0.
        for _ in range(pad_to - num_tokens):
            slots.append(-1)
            qsl.append(qsl[-1] + 1)
            seq_lens.append(0)
            tables.append([])
        num_decode = pad_to
    width = max(1, max(len(t) for t in tables))
    table_t = torch.zeros(len(tables), width, dtype=torch.int32)
    for i, t in enumerate(tables):
        table_t[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
    md = AttentionMetadata(
        num_actual_tokens=num_tokens,
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_table=table_t.to(device),
        max_query_len=max(n for _, n in order),
        max_seq_len=max(seq_lens[: len(order)]),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq_lens,
        num_decode_tokens=num_decode,
    )
    return md, order


@torch.inference_mode()  # as the engine's model runner calls backends
def _run(backend: type[AttentionBackend], case: dict[str, Any], scenario: Scenario,
         inputs: list[list[tuple[torch.Tensor, ...]]], device: torch.device,
         dtype: torch.dtype, num_blocks: int, seed: int,
         padded: bool = True) -> tuple[list, list]:
    """Outputs per step and layer, and the final caches, of `backend` on `scenario` (the
    reference runs it unpadded: padding must not change the real rows)."""
    h, kvh, d, bs = case["num_heads"], case["num_kv_heads"], case["head_size"], case["block_size"]
    gen = torch.Generator().manual_seed(seed)
    shape = backend.kv_cache_shape(num_blocks, bs, kvh, d)
    caches = [(torch.randn(shape, generator=gen) * 3).to(device=device, dtype=dtype)
              for _ in range(2)]
    impls = [backend.impl_cls()(h, d, d**-0.5, kvh, case["sliding_window"], case["soft_cap"])
             for _ in range(2)]
    alloc = _Allocator(bs)
    outputs = []
    for step, step_inputs in zip(scenario.steps, inputs, strict=True):
        for req, _ in step:
            if req not in alloc.blocks:
                alloc.start(req, scenario.shared.get(req))
        md, _ = build_step_metadata(alloc, step, device, scenario.pad_to if padded else None)
        md = backend.build_metadata(md)
        outs = []
        for layer, (q, k, v) in enumerate(step_inputs):
            rows = md.slot_mapping.shape[0]  # the step's tokens, padding rows included
            q, k, v = q[:rows], k[:rows], v[:rows]
            q_in = q.clone()
            out = impls[layer].forward(q, k, v, caches[layer], md)
            if not torch.equal(q, q_in):
                raise AssertionError(f"{backend.__name__} modified its query input in place")
            if tuple(out.shape) != (q.shape[0], h * d):
                raise AssertionError(f"{backend.__name__} returned shape {tuple(out.shape)} for q "
                                     f"of shape {tuple(q.shape)}; expected [T, num_heads * "
                                     f"head_size] = {(q.shape[0], h * d)}")
            if out.dtype != q.dtype:
                raise AssertionError(f"{backend.__name__} returned {out.dtype} for {q.dtype} "
                                     f"inputs; the output must be in the query's dtype")
            outs.append(out[: md.num_actual_tokens].float().cpu())
        outputs.append(outs)
    return outputs, caches


def _declared_capabilities(backend_cls: Any) -> dict[str, Any] | None:
    """The capabilities `backend_cls` is registered with, if it is registered."""
    from ember.registry import AttentionBackendRegistry

    target = f"{getattr(backend_cls, '__module__', '')}:{getattr(backend_cls, '__qualname__', '')}"
    for entry in AttentionBackendRegistry.entries():
        if entry.target == target:
            return entry.capabilities
    return None


def default_grid(backend_cls: Any) -> AttentionGrid:
    """The default grid, fitted to what the backend's registration declares."""
    caps = _declared_capabilities(backend_cls)
    if caps is None:
        return AttentionGrid()
    sizes = caps.get("head_sizes", "any")
    head_sizes = (64,) if sizes == "any" or 64 in sizes else (int(sizes[0]),)
    windows = (None, 7) if caps.get("sliding_window") else (None,)
    return AttentionGrid(head_sizes=head_sizes, sliding_windows=windows)


def check_backend_contract(backend_cls: type[AttentionBackend]) -> type[AttentionImpl]:
    """The backend's impl class, after checking what the runner relies on before any step."""
    name = getattr(backend_cls, "__name__", repr(backend_cls))
    if not isinstance(backend_cls, type):
        raise AssertionError(f"{name} is not a class: pass the AttentionBackend subclass")
    if getattr(backend_cls.impl_cls, "__func__", None) is AttentionBackend.impl_cls.__func__:
        raise AssertionError(f"{name} must override the classmethod impl_cls() to return its "
                             "AttentionImpl subclass")
    impl = backend_cls.impl_cls()
    if not isinstance(impl, type):
        raise AssertionError(f"{name}.impl_cls() returned {impl!r}, not a class")
    if getattr(impl, "forward", AttentionImpl.forward) is AttentionImpl.forward:
        raise AssertionError(f"{name}.impl_cls() returned {impl.__name__}, which does not "
                             "override forward()")
    return impl


@torch.inference_mode()
def _check_profile_step(backend: type[AttentionBackend], case: dict[str, Any],
                        device: torch.device, dtype: torch.dtype, seed: int) -> None:
    """The memory-profiling step: all tokens real, every slot -1: nothing may be written."""
    h, kvh, d, bs = case["num_heads"], case["num_kv_heads"], case["head_size"], case["block_size"]
    gen = torch.Generator().manual_seed(seed)
    alloc = _Allocator(bs)
    step = [(0, bs + 3), (1, 2)]
    for req, _ in step:
        alloc.start(req, None)
    md, _ = build_step_metadata(alloc, step, device, None)
    md.slot_mapping = torch.full_like(md.slot_mapping, -1)
    md.block_table = torch.zeros_like(md.block_table)
    md = backend.build_metadata(md)
    cache = (torch.randn(backend.kv_cache_shape(4, bs, kvh, d), generator=gen) * 3).to(
        device=device, dtype=dtype)
    before = cache.clone()
    t = md.num_actual_tokens
    q, k, v = (torch.randn(t, n, d, generator=gen).to(device=device, dtype=dtype)
               for n in (h, kvh, kvh))
    impl = backend.impl_cls()(h, d, d**-0.5, kvh, case["sliding_window"], case["soft_cap"])
    out = impl.forward(q, k, v, cache, md)
    if tuple(out.shape) != (t, h * d):
        raise AssertionError(f"{backend.__name__} returned shape {tuple(out.shape)} in a step "
                             f"whose slots are all -1; expected {(t, h * d)}")
    if not torch.equal(cache, before):
        raise AssertionError(f"{backend.__name__} changed the KV cache in a step whose slots are "
                             "all -1 (the engine's memory-profiling step: slot -1 means write "
                             "nothing)")


def _scenario_inputs(scenario: Scenario, case: dict[str, Any], device: torch.device,
                     dtype: torch.dtype, seed: int) -> list:
    gen = torch.Generator().manual_seed(seed)
    h, kvh, d = case["num_heads"], case["num_kv_heads"], case["head_size"]
    steps = []
    for step in scenario.steps:
        t = max(sum(n for _, n in step), scenario.pad_to or 0)
        layers = []
        for _ in range(2):
            q, k, v = (torch.randn(t, n, d, generator=gen).to(device=device, dtype=dtype)
                       for n in (h, kvh, kvh))
            layers.append((q, k, v))
        steps.append(layers)
    return steps


def check_attention_backend(
    backend_cls: type[AttentionBackend],
    *,
    device: str = "cpu",
    dtypes: Iterable[str] = ("float32",),
    grid: AttentionGrid | dict[str, Any] | None = None,
    reference: type[AttentionBackend] | None = None,
    atol: float | None = None,
    rtol: float | None = None,
    seed: int = 0,
) -> list[str]:
    """Compare `backend_cls` with the SDPA reference over the grid; AssertionError on the first
    mismatch (naming the case), else one summary line per case. Without a grid, a registered
    backend is run at what its registration declares: a sliding window when it declares
    `sliding_window=True`, and one of its declared head sizes."""
    if reference is None:
        from ember.attention_backends.sdpa import SdpaBackend as reference
    if isinstance(grid, dict):
        grid = AttentionGrid(**grid)
    grid = grid or default_grid(backend_cls)
    check_backend_contract(backend_cls)
    dev = torch.device(device)
    report = []
    for dtype_name, d, (h, kvh), bs, window, cap in itertools.product(
        [canonical_dtype(x) for x in dtypes], grid.head_sizes, grid.heads, grid.block_sizes,
        grid.sliding_windows, grid.soft_caps,
    ):
        dtype = getattr(torch, dtype_name)
        case = dict(num_heads=h, num_kv_heads=kvh, head_size=d, block_size=bs,
                    sliding_window=window, soft_cap=cap)
        default_atol, default_rtol = _TOL[dtype_name]
        for scenario in default_scenarios(bs):
            if grid.scenarios is not None and scenario.name not in grid.scenarios:
                continue
            if scenario.pad_to and not backend_cls.supports_cuda_graphs:
                continue  # only graph-safe backends get padded batches from the runner
            name = (f"{scenario.name} {dtype_name} heads={h}/{kvh} head_size={d} block={bs}"
                    + (f" window={window}" if window else "") + (f" soft_cap={cap}" if cap else ""))
            inputs = _scenario_inputs(scenario, case, dev, dtype, seed)
            tokens = sum(n for step in scenario.steps for _, n in step)
            reqs = {r for step in scenario.steps for r, _ in step}
            num_blocks = 2 + -(-tokens // bs) + len(reqs)  # block 0 (padding) + an upper bound
            got, got_caches = _run(backend_cls, case, scenario, inputs, dev, dtype,
                                   num_blocks, seed + 1)
            want, want_caches = _run(reference, case, scenario, inputs, dev, dtype,
                                     num_blocks, seed + 2, padded=False)
            worst = 0.0
            for step_i, (g_step, w_step) in enumerate(zip(got, want, strict=True)):
                for layer, (g, w) in enumerate(zip(g_step, w_step, strict=True)):
                    err = (g - w).abs().max().item() if g.numel() else 0.0
                    worst = max(worst, err)
                    if not torch.allclose(g, w, atol=atol or default_atol,
                                          rtol=rtol or default_rtol):
                        raise AssertionError(
                            f"{backend_cls.__name__} differs from {reference.__name__} in case "
                            f"[{name}], step {step_i}, layer {layer}: max abs error {err:.3g} "
                            f"(atol {atol or default_atol}, rtol {rtol or default_rtol})"
                        )
            _check_written_cache(backend_cls, reference, got_caches, want_caches, scenario, bs,
                                 name)
            report.append(f"ok  {name}: max abs error {worst:.3g}")
        _check_profile_step(backend_cls, case, dev, dtype, seed + 3)
    return report


def _check_written_cache(backend, reference, got, want, scenario, block_size, name) -> None:
    """When both keep the standard layout, the slots written must hold the same K/V."""
    if backend.kv_cache_shape(2, 4, 1, 8) != reference.kv_cache_shape(2, 4, 1, 8):
        return
    alloc = _Allocator(block_size)
    written: set[int] = set()
    for step in scenario.steps:
        for req, _ in step:
            if req not in alloc.blocks:
                alloc.start(req, scenario.shared.get(req))
        md, _ = build_step_metadata(alloc, step, torch.device("cpu"), None)
        written.update(md.slot_mapping.tolist())
    slots = torch.tensor(sorted(written), dtype=torch.int64)
    for layer, (g, w) in enumerate(zip(got, want, strict=True)):
        g_flat = g.flatten(1, 2).index_select(1, slots.to(g.device)).float().cpu()
        w_flat = w.flatten(1, 2).index_select(1, slots.to(w.device)).float().cpu()
        if not torch.equal(g_flat, w_flat):
            raise AssertionError(f"{backend.__name__} stored different K/V than "
                                 f"{reference.__name__} at the written slots in case [{name}], "
                                 f"layer {layer}")
