"""Warm-up: dummy steps through the real model runner at the shapes the engine will use, so
whatever compiles or loads lazily on first use does so during start-up, not in the first run.

On a GPU the Triton kernels compile once per specialization (a constexpr tile, a split count's
power-of-two bucket, an integer argument equal to 1 or divisible by 16), so the first steps of a
workload would otherwise pay for compiles: the prefill kernel per query-length bucket, the
decode kernel and its split reduce per split choice (mixed steps choose splits from the step's
longest sequence), the greedy argmax, and whatever torch loads at its first sort, softmax or
log-softmax. The plan below covers each of those axes without knowing any kernel's policy:

- the largest prefill step (max_num_batched_tokens, as memory profiling runs it), sampling a
  mix of greedy and random rows;
- one short prefill per power-of-two query length from 2 to 256 (the prefill tiles follow it);
  one asks for logprobs and prompt logprobs;
- pure decode at powers of two up to max_num_seqs (graph replays where graphs exist, eager
  steps otherwise), greedy, random (top-k/top-p, seeded, penalties) and logprobs rows;
- mixed steps (a few decodes beside a short chunk whose context is L tokens long) for decode
  counts 1, 4, 16, 64 and L in {2, 3} x 2^k up to max_model_len: the split-KV decode chooses its
  split count from the decode count and L.
Where the device is the host nothing compiles per shape (no Triton on the CPU, and memory
profiling has already run the largest step), so there one small mixed step takes the runner's
main paths once (the first forward's one-time costs move into start-up), then one one-token
step (a compiled model traces it apart), and the sweeps are skipped.

Dummy requests write their keys and values into the first blocks of the pool (block ids wrap
around num_blocks); the KV cache manager does not exist yet and never hears of them, and those
blocks are zeroed afterwards, so the engine starts from exactly the state it would have without
warm-up. The random number generators are restored too: unseeded sampling draws the same
numbers as it would have.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, NamedTuple

import torch

from ember.core.scheduler_output import NewRequestData, SchedulerOutput
from ember.sampling_params import SamplingParams

if TYPE_CHECKING:
    from ember.worker.model_runner import ModelRunner

logger = logging.getLogger("ember")

GREEDY = SamplingParams(temperature=0.0)
TOP_K_TOP_P = SamplingParams(temperature=0.8, top_p=0.9, top_k=50)
PLAIN_RANDOM = SamplingParams(temperature=1.0)
SEEDED = SamplingParams(temperature=1.0, seed=0)
PENALTIES = SamplingParams(temperature=0.0, repetition_penalty=1.1, presence_penalty=0.1)
LOGPROBS = SamplingParams(temperature=0.0, logprobs=5)
PROMPT_LOGPROBS = SamplingParams(temperature=0.0, logprobs=1, prompt_logprobs=1)

SHORT_PREFILL_MAX = 256
MIXED_DECODE_COUNTS = (1, 4, 16, 64)
DECODE_CONTEXT = 2  # tokens of a decode request: one computed, one to decode


class DummyRequest(NamedTuple):
    """A request of ``num_tokens`` prompt tokens whose last ``num_scheduled`` run this step."""

    num_tokens: int
    num_scheduled: int
    params: SamplingParams = GREEDY


def _powers_of_two(lo: int, hi: int) -> list[int]:
    sizes, n = [], lo
    while n <= hi:
        sizes.append(n)
        n *= 2
    return sizes


def _rotate(params: tuple[SamplingParams, ...], n: int) -> list[SamplingParams]:
    return [params[i % len(params)] for i in range(n)]


def largest_prefill(max_tokens: int, max_num_seqs: int, max_model_len: int) -> list[DummyRequest]:
    """The biggest step the scheduler can make of fresh prompts (what memory profiling runs)."""
    num_reqs = min(max(-(-max_tokens // max_model_len), 1), max_num_seqs)
    per_req = min(max_model_len, max(max_tokens // num_reqs, 1))
    params = _rotate((GREEDY, TOP_K_TOP_P), num_reqs)
    return [DummyRequest(per_req, per_req, p) for p in params]


def warmup_plan(max_tokens: int, max_num_seqs: int, max_model_len: int,
                full: bool) -> list[list[DummyRequest]]:
    """The dummy steps, in order (see the module docstring for why each is there). Without
    ``full`` (a device that compiles nothing per shape) one small mixed step takes the
    runner's main paths once: a greedy and a seeded decode beside a chunk with prompt logprobs
    (as many of those rows as max_num_seqs and max_num_batched_tokens allow), then one
    one-token step."""
    special = (TOP_K_TOP_P, SEEDED, PENALTIES, LOGPROBS, PLAIN_RANDOM, GREEDY)
    if not full:
        one_token = [DummyRequest(DECODE_CONTEXT, 1, SEEDED)]
        decodes = [DummyRequest(DECODE_CONTEXT, 1, p) for p in (SEEDED, GREEDY)]
        while decodes and (len(decodes) + 1 > max_num_seqs or len(decodes) + 2 > max_tokens):
            decodes.pop()  # room for the chunk first
        chunk = min(4, max_tokens - len(decodes), max_model_len)
        if chunk < 2:
            return [one_token]
        # Then a one-token step: torch.compile (compile_model) traces a step of one token
        # apart from longer ones (dynamo specializes sizes 0 and 1).
        return [decodes + [DummyRequest(chunk, chunk, PROMPT_LOGPROBS)], one_token]
    steps = [largest_prefill(max_tokens, max_num_seqs, max_model_len)]
    longest_chunk = min(max_tokens, max_model_len, SHORT_PREFILL_MAX)
    chunks = _powers_of_two(2, longest_chunk)
    for q in chunks:  # the longest asks for prompt logprobs too
        steps.append([DummyRequest(q, q, PROMPT_LOGPROBS if q == chunks[-1] else GREEDY)])
    batches = [n for n in sorted({*_powers_of_two(1, max_num_seqs), max_num_seqs})
               if n <= max_tokens]
    for n in batches:
        steps.append([DummyRequest(DECODE_CONTEXT, 1) for _ in range(n)])
    # The sampler's other paths (a mix of random, seeded, penalised and logprob rows, and a
    # batch of random rows only), at a small and at the largest batch.
    for n in sorted({min(len(special), batches[-1]), batches[-1]}):
        steps.append([DummyRequest(DECODE_CONTEXT, 1, p) for p in _rotate(special, n)])
    steps.append([DummyRequest(DECODE_CONTEXT, 1, PLAIN_RANDOM)])
    return steps + _mixed_sweep(max_tokens, max_num_seqs, max_model_len)


def _mixed_sweep(max_tokens: int, max_num_seqs: int,
                 max_model_len: int) -> list[list[DummyRequest]]:
    """Decodes beside a two-token chunk whose context is L tokens long: the step's longest
    sequence (L) and its decode count are what a split-KV decode chooses its splits from."""
    chunk = 2
    contexts = sorted({m << k for m in (2, 3) for k in range(5, 24) if (m << k) <= max_model_len}
                      | {max_model_len})
    steps = []
    for d in MIXED_DECODE_COUNTS:
        if d + 1 > max_num_seqs or d + chunk > max_tokens:
            break
        for context in contexts:
            steps.append([DummyRequest(DECODE_CONTEXT, 1)] * d + [DummyRequest(context, chunk)])
    return steps


def _new_request(req_id: str, dummy: DummyRequest, block_size: int,
                 num_blocks: int) -> NewRequestData:
    # Block ids wrap around the pool: requests may share blocks (their keys are junk anyway).
    num_req_blocks = -(-dummy.num_tokens // block_size)
    return NewRequestData(
        req_id=req_id,
        prompt_token_ids=[0] * dummy.num_tokens,
        output_token_ids=[],
        sampling_params=dummy.params,
        block_ids=[b % num_blocks for b in range(num_req_blocks)],
        num_computed_tokens=dummy.num_tokens - dummy.num_scheduled,
    )


def _run_step(runner: ModelRunner, step: list[DummyRequest], index: int, num_blocks: int) -> None:
    out = SchedulerOutput()
    for i, dummy in enumerate(step):
        req_id = f"__warmup_{index}_{i}"
        out.new_requests.append(_new_request(req_id, dummy, runner.block_size, num_blocks))
        out.num_scheduled_tokens[req_id] = dummy.num_scheduled
    out.total_num_scheduled_tokens = sum(out.num_scheduled_tokens.values())
    runner.launch(out).resolve()
    # Drop the requests again (an empty step only updates the runner's state).
    runner.launch(SchedulerOutput(finished_req_ids=set(out.num_scheduled_tokens)))


def _zero_blocks(runner: ModelRunner, num_blocks: int, count: int) -> None:
    """Zero blocks [0, count) of every layer's cache. The block axis is the one that grows when
    the backend's cache shape is asked for one block more; if that is not a single axis, zero
    it all (writing a whole host cache would cost seconds: its pages are still untouched)."""
    num_layers, kv_heads, head_size = runner.kv_geometry()
    shape = runner.attn_backend.kv_cache_shape
    sizes = shape(num_blocks, runner.block_size, kv_heads, head_size)
    grown = shape(num_blocks + 1, runner.block_size, kv_heads, head_size)
    axes = [i for i, (a, b) in enumerate(zip(sizes, grown)) if a != b]
    for cache in runner.kv_caches:
        if len(axes) == 1 and len(sizes) == len(grown) and tuple(cache.shape) == tuple(sizes):
            cache.narrow(axes[0], 0, count).zero_()
        else:
            cache.zero_()


def _fork_rng(device: torch.device):
    if device.type == "cpu":
        return torch.random.fork_rng(devices=[])
    index = device.index
    if index is None:
        index = getattr(torch, device.type).current_device()
    return torch.random.fork_rng(devices=[index], device_type=device.type)


def run_warmup(runner: ModelRunner, num_blocks: int, max_tokens: int, max_num_seqs: int,
               full: bool | None = None) -> int:
    """Run the warm-up plan on ``runner`` (KV cache allocated, graphs captured); returns the
    number of steps. Leaves the runner, the KV caches and the RNGs as it found them. ``full``
    (default: unless the device is the host) runs the shape sweeps."""
    if num_blocks <= 0:
        return 0
    platform = runner.platform
    if full is None:
        full = not platform.device_is_host()
    plan = warmup_plan(max_tokens, max_num_seqs, runner.model_config.max_model_len, full)
    start = time.perf_counter()
    with _fork_rng(runner.device):
        for index, step in enumerate(plan):
            _run_step(runner, step, index, num_blocks)
        platform.synchronize()
    runner.in_flight = None
    # Junk from the dummy requests: start from the state the engine would have without warm-up.
    used = min(max(-(-r.num_tokens // runner.block_size) for step in plan for r in step),
               num_blocks)
    _zero_blocks(runner, num_blocks, used)
    platform.synchronize()
    logger.info("warm-up: %d dummy steps in %.1f s", len(plan), time.perf_counter() - start)
    return len(plan)
