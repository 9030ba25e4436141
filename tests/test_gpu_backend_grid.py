"""Every CUDA attention backend against the SDPA reference, over a grid of shapes and scenarios.

Each case plays the model runner for a few steps: it assigns random, non-contiguous cache blocks
to the requests, orders every step's batch as ``build_flat_batch`` does (one-token requests
first), builds a fresh ``AttentionMetadata`` per step and backend, calls ``build_metadata`` once
per step, and runs two ``Attention`` layers (sharing that metadata, as a model's layers do)
through a ``ForwardContext``. The backend under test and SDPA get identical inputs and caches
that start identical (random garbage, plus the same pre-written context), and run in lockstep:
after every step their outputs must agree (bf16 tolerances, and a per-request relative error so
that small outputs over long contexts are checked too) and their caches must be bit-identical.

Scenarios: a decode batch with contexts up to 32k, a fresh multi-prompt prefill, prefix-cache hits
(blocks written earlier, and blocks shared with another request), a prompt prefilled in three
chunks, and a mixed batch of decodes and prefill chunks over two steps.

Shapes: head sizes 64 and 128 x GQA ratios 1, 4 and 8 x a small (16) and a large cache block,
in bfloat16, plus one float16 case. Block size is paired with the other two axes (every value
and every pair of values appears) rather than crossed with them: each Triton kernel
specialisation costs a compile, which dominates the file's GPU time. FlashInfer JIT-compiles its
kernels per head size and dtype, so it runs in bfloat16 only.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field

import pytest
import torch

from ember.attention_backends.base import AttentionBackend, AttentionMetadata
from ember.attention_backends.sdpa import SdpaBackend
from ember.layers.attention import Attention, ForwardContext
from ember.registry import AttentionBackendRegistry

BACKENDS = ("triton", "flashinfer")
# The large block size per backend. Triton gathers keys one by one through the block table, so a
# block larger than its key tile (64) is the interesting case; FlashInfer pages of 64 are the
# size test_gpu_engine already runs it with.
BLOCK_SIZES: dict[str, tuple[int, int]] = {"triton": (16, 128), "flashinfer": (16, 64)}
SMALL, LARGE = 0, 1
SHAPES = [  # (head_size, num_heads, num_kv_heads, SMALL | LARGE block): GQA 1, 4, 8 per head size
    (64, 8, 8, SMALL),
    (64, 16, 4, LARGE),
    (64, 32, 4, SMALL),
    (128, 8, 8, LARGE),
    (128, 16, 4, SMALL),
    (128, 32, 4, LARGE),
]
NUM_LAYERS = 2
ATOL = RTOL = 2e-2
# Outputs over long contexts average thousands of random values and are small, where ATOL alone
# could not tell a skipped block from rounding. bf16 SDPA is ~0.25% off a float32 one here.
REL_TOL = 1e-2


@dataclass(frozen=True)
class Scenario:
    """Steps of (request, new tokens), listed in any order (the runner's order is applied).

    ``cached``: tokens of a request whose K/V are already in the cache before the first step
    (written directly, as earlier steps or a finished request would have). ``shared``: a request
    that starts on the first ``tokens`` (whole blocks) of another request's blocks, a prefix-cache
    hit on physically shared blocks.
    """

    steps: list[list[tuple[int, int]]]
    cached: dict[int, int] = field(default_factory=dict)
    shared: dict[int, tuple[int, int]] = field(default_factory=dict)


SCENARIOS: dict[str, Scenario] = {
    # seq_lens [1, 17, 4099, 32768]; request 0 is a one-token prompt, which the runner batches
    # with the decodes (query_len == 1).
    "decode": Scenario([[(0, 1), (1, 1), (2, 1), (3, 1)]], cached={1: 16, 2: 4098, 3: 32767}),
    "prefill": Scenario([[(0, 517), (1, 33), (2, 2048), (3, 1200)]]),
    # Request 0 computes its prompt; then 1 and 2 start on its first 2048 and 1024 tokens (whole
    # blocks for every block size here), and 3 on 1024 tokens written before the first step.
    "prefix_hit": Scenario([[(0, 2100)], [(1, 300), (2, 77), (3, 500)]], cached={3: 1024},
                           shared={1: (0, 2048), 2: (0, 1024)}),
    # Chunk boundaries (5000, 13192) fall inside blocks, as a token budget makes them.
    "chunked_prefill": Scenario([[(0, 5000)], [(0, 8192)], [(0, 3000)]]),
    # Step 1: decodes at 9001 and 41, a fresh prompt, a chunk continuing after 3000 tokens, and a
    # prefix hit on request 0's blocks; step 2: the prompt's request decodes, the chunk goes on.
    "mixed": Scenario([[(3, 700), (0, 1), (4, 1000), (1, 1), (5, 300)],
                       [(4, 1200), (0, 1), (3, 1), (1, 1), (5, 1)]],
                      cached={0: 9000, 1: 40, 4: 3000}, shared={5: (0, 4096)}),
}


def _device() -> torch.device:
    """Where the grid runs: one helper, so that no other line names the device."""
    return torch.device("cuda")


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _backend(name: str) -> type[AttentionBackend]:
    """The backend registered under `name`, skipping the case when what it needs is missing."""
    requires = AttentionBackendRegistry.entry(name).capabilities.get("requires", [])
    for module in requires:
        pytest.importorskip(module)
    if "triton" in requires and _interpreting():
        pytest.skip("TRITON_INTERPRET is set: the interpreter would take hours over this grid")
    backend = AttentionBackendRegistry.resolve(name)
    if backend.kv_cache_shape(3, 16, 2, 64) != SdpaBackend.kv_cache_shape(3, 16, 2, 64):
        # Pre-written context and the cache comparison both address the standard layout.
        pytest.skip(f"{name} keeps a non-standard KV cache layout")
    return backend


# ----------------------------------------------------------------------------- the runner's part


@dataclass
class _Step:
    """One step in batch order, as host data (each backend gets its own metadata objects)."""

    reqs: list[int]
    query_lens: list[int]
    seq_lens: list[int]
    slots: list[int]
    block_table: list[list[int]]


@dataclass
class _Plan:
    num_blocks: int
    preload: dict[int, list[int]]  # request -> cache slots of its `cached` tokens
    steps: list[_Step]


def _plan(scenario: Scenario, block_size: int, seed: int) -> _Plan:
    """Block assignment and per-step batches, as the scheduler and the runner would make them."""
    rng = random.Random(seed)
    total = dict(scenario.cached)
    for req, (_, tokens) in scenario.shared.items():
        total[req] = total.get(req, 0) + tokens
    for step in scenario.steps:
        for req, n in step:
            total[req] = total.get(req, 0) + n
    need = sum(-(-n // block_size) for n in total.values())
    num_blocks = need + need // 4 + 8  # spare blocks, so the ids in use are scattered
    free = list(range(num_blocks))
    rng.shuffle(free)
    blocks: dict[int, list[int]] = {}
    computed: dict[int, int] = {}

    def grow(req: int, tokens: int) -> None:
        while len(blocks[req]) * block_size < tokens:
            blocks[req].append(free.pop())

    def slot(req: int, pos: int) -> int:
        return blocks[req][pos // block_size] * block_size + pos % block_size

    preload = {}
    for req, n in scenario.cached.items():
        assert req not in scenario.shared, "a request starts either cached or shared"
        blocks[req] = []
        grow(req, n)
        computed[req] = n
        preload[req] = [slot(req, p) for p in range(n)]
    steps = []
    for step in scenario.steps:
        for req, _ in step:
            if req in blocks:
                continue
            if req in scenario.shared:
                src, tokens = scenario.shared[req]
                assert tokens % block_size == 0 and computed[src] >= tokens, (req, src, tokens)
                blocks[req] = blocks[src][: tokens // block_size]
                computed[req] = tokens
            else:
                blocks[req], computed[req] = [], 0
        # Decodes (one new token) first, otherwise in scheduling order: build_flat_batch's sort.
        order = sorted(step, key=lambda rn: rn[1] != 1)
        slots: list[int] = []
        for req, n in order:
            grow(req, computed[req] + n)
            slots += [slot(req, p) for p in range(computed[req], computed[req] + n)]
            computed[req] += n
        width = max(len(blocks[req]) for req, _ in order)
        # Past a request's blocks the runner's table rows hold stale ids of earlier requests:
        # pad with random valid ids, so reading past the end reads real, wrong data.
        table = [blocks[req] + [rng.randrange(num_blocks) for _ in range(width - len(blocks[req]))]
                 for req, _ in order]
        steps.append(_Step([req for req, _ in order], [n for _, n in order],
                           [computed[req] for req, _ in order], slots, table))
    return _Plan(num_blocks, preload, steps)


def _metadata(step: _Step, device: torch.device) -> AttentionMetadata:
    """The step's metadata, built as ModelRunner._metadata builds it."""
    qsl = [0]
    for n in step.query_lens:
        qsl.append(qsl[-1] + n)
    return AttentionMetadata(
        num_actual_tokens=qsl[-1],
        slot_mapping=torch.tensor(step.slots, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(step.seq_lens, dtype=torch.int32, device=device),
        block_table=torch.tensor(step.block_table, dtype=torch.int32, device=device),
        max_query_len=max(step.query_lens),
        max_seq_len=max(step.seq_lens),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=list(step.seq_lens),
        num_decode_tokens=sum(n == 1 for n in step.query_lens),
    )


class _Model:
    """NUM_LAYERS attention layers of one backend with their paged caches."""

    def __init__(self, backend: type[AttentionBackend], num_heads: int, num_kv_heads: int,
                 head_size: int, caches: list[torch.Tensor]) -> None:
        self.backend = backend
        self.layers = [Attention(num_heads, head_size, head_size**-0.5, num_kv_heads, i, backend)
                       for i in range(NUM_LAYERS)]
        self.caches = caches

    @torch.inference_mode()  # as the model runner runs the model
    def step(self, step: _Step, inputs: list[tuple[torch.Tensor, ...]]) -> list[torch.Tensor]:
        md = self.backend.build_metadata(_metadata(step, self.caches[0].device))
        ctx = ForwardContext(attn_metadata=md, kv_caches=self.caches)
        outs = []
        for layer, (q, k, v) in zip(self.layers, inputs, strict=True):
            out = layer(q, k, v, ctx)
            assert out.shape == (q.shape[0], layer.num_heads * layer.head_size), out.shape
            outs.append(out[: md.num_actual_tokens])
        return outs


def _step_inputs(num_tokens: int, num_heads: int, num_kv_heads: int, head_size: int,
                 dtype: torch.dtype, gen: torch.Generator) -> list[tuple[torch.Tensor, ...]]:
    """q, k, v per layer as a model hands them over: q and k fresh from RoPE (contiguous), v a
    strided slice of the fused qkv projection."""
    sizes = [num_heads * head_size, num_kv_heads * head_size, num_kv_heads * head_size]
    layers = []
    for _ in range(NUM_LAYERS):
        qkv = torch.randn(num_tokens, sum(sizes), generator=gen, device=gen.device).to(dtype)
        q, k, v = qkv.split(sizes, dim=-1)
        layers.append((q.contiguous(), k.contiguous(), v))
    return layers


def _assert_close(got: torch.Tensor, want: torch.Tensor, step: _Step, where: str) -> None:
    got, want = got.float(), want.float()
    assert bool(got.isfinite().all()), f"{where}: non-finite output"
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL, msg=lambda m: f"{where}: {m}")
    start = 0
    for req, n, seq_len in zip(step.reqs, step.query_lens, step.seq_lens, strict=True):
        g, w = got[start : start + n], want[start : start + n]
        rel = ((g - w).norm() / w.norm().clamp_min(1e-6)).item()
        assert rel <= REL_TOL, (f"{where}, request {req} ({n} new of {seq_len} tokens): "
                                f"relative error {rel:.3g} > {REL_TOL}")
        start += n


# ----------------------------------------------------------------------------- the grid


def _cases() -> list:
    cases = []
    for name in BACKENDS:
        for head_size, num_heads, num_kv_heads, block in SHAPES:
            block_size = BLOCK_SIZES[name][block]
            for scenario in SCENARIOS:
                cases.append(pytest.param(
                    name, scenario, head_size, num_heads, num_kv_heads, block_size, torch.bfloat16,
                    id=f"{name}-{scenario}-d{head_size}-h{num_heads}kv{num_kv_heads}-b{block_size}-bf16",
                ))
    # One float16 case, Triton only: FlashInfer would JIT-compile a second dtype for it.
    cases.append(pytest.param("triton", "mixed", 128, 32, 4, 16, torch.float16,
                              id="triton-mixed-d128-h32kv4-b16-fp16"))
    return cases


@pytest.mark.gpu
@pytest.mark.parametrize(
    "backend_name,scenario,head_size,num_heads,num_kv_heads,block_size,dtype", _cases()
)
def test_backend_matches_sdpa(backend_name: str, scenario: str, head_size: int, num_heads: int,
                              num_kv_heads: int, block_size: int, dtype: torch.dtype) -> None:
    backend = _backend(backend_name)
    device = _device()
    plan = _plan(SCENARIOS[scenario], block_size, seed=0)
    gen = torch.Generator(device=device).manual_seed(1)
    shape = SdpaBackend.kv_cache_shape(plan.num_blocks, block_size, num_kv_heads, head_size)
    # Garbage larger than real keys: a backend that reads an unwritten or masked slot gets
    # scores that dominate its softmax, instead of an error hidden in rounding.
    garbage = [(3 * torch.randn(shape, generator=gen, device=device)).to(dtype)
               for _ in range(NUM_LAYERS)]
    for cache in garbage:
        flat = cache.view(2, -1, num_kv_heads, head_size)
        for slots in plan.preload.values():
            kv = torch.randn(2, len(slots), num_kv_heads, head_size, generator=gen, device=device)
            flat[:, torch.tensor(slots, device=device)] = kv.to(dtype)
    ref = _Model(SdpaBackend, num_heads, num_kv_heads, head_size, [c.clone() for c in garbage])
    model = _Model(backend, num_heads, num_kv_heads, head_size, garbage)
    for i, step in enumerate(plan.steps):
        inputs = _step_inputs(len(step.slots), num_heads, num_kv_heads, head_size, dtype, gen)
        want = ref.step(step, inputs)
        got = model.step(step, inputs)
        for layer in range(NUM_LAYERS):
            where = f"{backend_name} vs sdpa, {scenario} step {i} layer {layer}"
            _assert_close(got[layer], want[layer], step, where)
            # Both stores are plain copies into caches that started identical: every slot,
            # written or not, must match bit for bit.
            assert torch.equal(model.caches[layer], ref.caches[layer]), f"{where}: KV caches differ"
