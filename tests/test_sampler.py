"""Tests for the batched sampler, its metadata builder and SamplingParams validation."""

from __future__ import annotations

import math

import pytest
import torch

from ember.layers.sampler import (
    Sampler,
    apply_penalties,
    apply_top_k_top_p,
    compute_prompt_logprobs,
)
from ember.layers.sampling_metadata import build_sampling_metadata, make_generator
from ember.sampling_params import SamplingParams

V = 8
# Fixed logits of the statistical tests: distinct values so no top-k/top-p boundary is a tie.
BASE_LOGITS = [2.0, 1.5, 1.1, 0.7, 0.2, -0.3, -1.0, -2.2]
# chi-square 0.999 quantiles for df = 1..7 (no scipy here); the draws are seeded, so a pass is
# deterministic, and a correct sampler fails a fresh seed only 0.1% of the time.
CHI2_999 = [10.828, 13.816, 16.266, 18.467, 20.515, 22.458, 24.322]


def _md(params, logits_rows=None, outputs=None, prompts=None, generators=None, vocab=V):
    n = len(params)
    return build_sampling_metadata(
        params,
        outputs if outputs is not None else [[] for _ in range(n)],
        prompts if prompts is not None else [[] for _ in range(n)],
        generators or {},
        vocab,
        "cpu",
    )


def _target_distribution(logits, temperature, top_k=-1, top_p=1.0, min_p=0.0):
    """The exact law the spec defines, computed independently in float64."""
    x = torch.tensor(logits, dtype=torch.float64) / temperature
    p = torch.softmax(x, dim=0)
    keep = p >= min_p * p.max()
    if top_k > 0:
        kth = torch.sort(x[keep], descending=True).values[min(top_k, int(keep.sum())) - 1]
        keep &= x >= kth
    if top_p < 1.0:
        q = torch.where(keep, p, torch.zeros_like(p))
        q = q / q.sum()
        order = torch.argsort(q, descending=True)
        kept_p = torch.zeros_like(keep)
        total = 0.0
        for i in order.tolist():  # smallest prefix whose mass reaches top_p
            kept_p[i] = True
            total += q[i].item()
            if total >= top_p:
                break
        keep &= kept_p
    out = torch.where(keep, p, torch.zeros_like(p))
    return out / out.sum()


# ---------------------------------------------------------------- greedy


def test_temperature_zero_is_argmax():
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    params = [SamplingParams(temperature=0.0) for _ in range(6)]
    out = Sampler()(logits, _md(params, vocab=50))
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))
    assert out.logprobs is None


def test_top_k_one_equals_greedy():
    torch.manual_seed(1)
    logits = torch.randn(16, 100)
    params = [SamplingParams(temperature=t, top_k=1) for t in (0.3, 1.0, 2.5, 7.0)] * 4
    out = Sampler()(logits, _md(params, vocab=100))
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))


def test_empty_batch():
    out = Sampler()(torch.empty(0, V), _md([]))
    assert out.sampled_token_ids.shape == (0,)


def test_mixed_greedy_and_random_batch():
    torch.manual_seed(2)
    logits = torch.randn(4, 30)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_k=1)] * 2
    md = _md(params, vocab=30)
    assert not md.all_greedy and not md.all_random
    out = Sampler()(logits, md)
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))


# ---------------------------------------------------------------- distribution


CASES = {
    "temperature": dict(temperature=0.7),
    "top_k": dict(temperature=1.0, top_k=3),
    "top_p": dict(temperature=1.5, top_p=0.8),
    "min_p": dict(temperature=0.6, min_p=0.1),  # min-p after temperature keeps 4, before: 6
    "all": dict(temperature=0.9, top_k=4, top_p=0.75, min_p=0.05),
}


@pytest.mark.parametrize("name", list(CASES))
def test_empirical_distribution_matches_target(name):
    cfg = CASES[name]
    n = 20_000
    # One batch also holding other settings' rows: rows must not leak into each other.
    others = [dict(temperature=0.0), dict(temperature=2.0, top_k=2)]
    params = [SamplingParams(**cfg)] * n + [SamplingParams(**o) for o in others]
    logits = torch.tensor(BASE_LOGITS).expand(len(params), V).contiguous()
    torch.manual_seed(1234)
    sampled = Sampler()(logits, _md(params)).sampled_token_ids
    assert torch.equal(logits[0], torch.tensor(BASE_LOGITS))  # the caller's logits untouched
    assert sampled[n] == 0 and sampled[n + 1] in (0, 1)
    counts = torch.bincount(sampled[:n], minlength=V).double()
    target = _target_distribution(BASE_LOGITS, **cfg)

    excluded = target == 0
    assert counts[excluded].sum() == 0, f"excluded tokens sampled: {counts}"
    kept = ~excluded
    expected = target[kept] * n
    chi2 = ((counts[kept] - expected) ** 2 / expected).sum().item()
    df = int(kept.sum()) - 1
    if df > 0:
        assert chi2 < CHI2_999[df - 1], f"chi2={chi2:.2f} df={df} counts={counts} target={target}"
    tv = 0.5 * (counts / n - target).abs().sum().item()
    assert tv < 0.02, tv


def test_top_k_fast_path_equals_sort_path():
    torch.manual_seed(3)
    logits = torch.randn(5, 40)
    logits[0, :3] = 1.0  # a tie at the k-th value: both paths keep all tied tokens
    k = torch.tensor([3, 1, 40, 7, 40])
    fast = apply_top_k_top_p(logits.clone(), k, None, max_top_k=7)
    slow = apply_top_k_top_p(logits.clone(), k, torch.ones(5), max_top_k=7)
    assert torch.equal(fast, slow)
    assert torch.isfinite(fast).sum(-1).tolist()[1:] == [1, 40, 7, 40]
    assert torch.isfinite(fast[0]).sum() >= 3


def test_top_p_keeps_at_least_one_token():
    logits = torch.tensor([[5.0, 0.0, -1.0, -3.0]])
    out = apply_top_k_top_p(logits.clone(), None, torch.tensor([1e-6]))
    assert torch.isfinite(out).sum() == 1 and out[0, 0] == 5.0


# ---------------------------------------------------------------- seeds


def _seeded_row(seed: int, row: int, batch: int, steps: int = 5) -> list[int]:
    """Tokens of a seeded row across `steps` steps, at index `row` of a batch of `batch`."""
    torch.manual_seed(99 + batch)  # unseeded neighbours differ between the two setups
    gen = make_generator(seed)
    logits = torch.randn(batch, 64)
    logits[row] = torch.linspace(-1, 1, 64)
    params = [SamplingParams(temperature=1.0) for _ in range(batch)]
    params[row] = SamplingParams(temperature=0.8, top_p=0.95, seed=seed)
    tokens = []
    for _ in range(steps):
        md = _md(params, generators={row: gen}, vocab=64)
        tokens.append(Sampler()(logits, md).sampled_token_ids[row].item())
    return tokens


def test_seeded_row_is_batch_invariant():
    alone = _seeded_row(seed=7, row=0, batch=1)
    batched = _seeded_row(seed=7, row=5, batch=9)
    assert alone == batched
    assert _seeded_row(seed=8, row=0, batch=1) != alone


def test_greedy_rows_do_not_advance_generators():
    gen = make_generator(3)
    md = _md([SamplingParams(temperature=0.0, seed=3)], generators={0: gen})
    assert md.generators == {}


# ---------------------------------------------------------------- penalties


LOGITS5 = [2.0, -1.0, 0.5, 3.0, -2.0]
PROMPT = [[0, 4]]
OUTPUT = [[1, 3, 3]]


def _penalised(**kw) -> list[float]:
    md = _md([SamplingParams(**kw)], outputs=OUTPUT, prompts=PROMPT, vocab=5)
    return apply_penalties(torch.tensor([LOGITS5]), md)[0].tolist()


def test_repetition_penalty_prompt_and_output():
    # seen = {0, 4} (prompt) | {1, 3} (output): positives divided, negatives multiplied.
    assert _penalised(repetition_penalty=2.0) == pytest.approx([1.0, -2.0, 0.5, 1.5, -4.0])


def test_frequency_penalty_counts_output_only():
    assert _penalised(frequency_penalty=0.5) == pytest.approx([2.0, -1.5, 0.5, 2.0, -2.0])


def test_presence_penalty_output_only():
    assert _penalised(presence_penalty=0.3) == pytest.approx([2.0, -1.3, 0.5, 2.7, -2.0])


def test_penalties_combined_and_per_row():
    params = [
        SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.3),
        SamplingParams(),  # unpenalised row in the same batch
    ]
    md = _md(params, outputs=OUTPUT + [[1]], prompts=PROMPT + [[0]], vocab=5)
    out = apply_penalties(torch.tensor([LOGITS5, LOGITS5]), md)
    # repetition first, then -0.5*count, then -0.3*present.
    assert out[0].tolist() == pytest.approx([1.0, -2.0 - 0.5 - 0.3, 0.5, 1.5 - 1.0 - 0.3, -4.0])
    assert out[1].tolist() == pytest.approx(LOGITS5)
    # A hand-built metadata without the padded id tensors gives the same result.
    md.output_ids_padded = md.prompt_ids_padded = None
    assert torch.equal(apply_penalties(torch.tensor([LOGITS5, LOGITS5]), md), out)


def test_penalty_changes_greedy_choice():
    md = _md([SamplingParams(temperature=0.0, presence_penalty=2.0)], outputs=[[3]], vocab=5)
    assert Sampler()(torch.tensor([LOGITS5]), md).sampled_token_ids.item() == 0


def test_no_penalty_tensors_when_unused():
    md = _md([SamplingParams(), SamplingParams(temperature=0.0)])
    assert md.no_penalties and md.top_k is None and md.top_p is None
    assert not md.processors.before_penalties and not md.processors.after_temperature


# ---------------------------------------------------------------- logprobs


def test_logprobs_are_raw_and_ranked():
    torch.manual_seed(4)
    logits = torch.randn(6, 30)
    params = [
        SamplingParams(temperature=0.5, top_k=4, logprobs=3, repetition_penalty=1.5),
        SamplingParams(temperature=0.0, logprobs=0),
        SamplingParams(temperature=2.0, frequency_penalty=1.0),
    ] * 2
    md = _md(params, outputs=[[1, 2, 2]] * 6, prompts=[[5]] * 6, vocab=30)
    assert md.max_num_logprobs == 3
    out = Sampler()(logits, md)
    lp = out.logprobs
    raw = torch.log_softmax(logits, dim=-1)
    sampled = out.sampled_token_ids
    assert lp.logprob_token_ids.shape == (6, 4) and lp.logprobs.shape == (6, 4)
    assert torch.equal(lp.logprob_token_ids[:, 0], sampled)
    assert torch.allclose(lp.logprobs, raw.gather(1, lp.logprob_token_ids))
    assert torch.equal(lp.logprob_token_ids[:, 1:], raw.topk(3, dim=-1).indices)
    for i in range(6):
        expected_rank = 1 + int((raw[i] > raw[i, sampled[i]]).sum())
        assert lp.selected_token_ranks[i].item() == expected_rank


def test_prompt_logprobs():
    torch.manual_seed(5)
    logits = torch.randn(4, 20)
    target = torch.tensor([3, 0, 19, 7])
    lp = compute_prompt_logprobs(logits, target, k=2)
    raw = torch.log_softmax(logits, dim=-1)
    assert torch.equal(lp.logprob_token_ids[:, 0], target)
    assert torch.allclose(lp.logprobs[:, 0], raw[torch.arange(4), target])
    assert torch.allclose(lp.logprobs[:, 1:], raw.topk(2, dim=-1).values)
    ranks = (raw > raw[torch.arange(4), target].unsqueeze(1)).sum(-1) + 1
    assert torch.equal(lp.selected_token_ranks, ranks)
    ids, vals, r = lp.tolists()
    assert len(ids) == 4 and len(ids[0]) == 3 and r == ranks.tolist()


# ---------------------------------------------------------------- min_tokens


def test_min_tokens_masks_eos_and_stop_ids():
    logits = torch.tensor([[0.0, 1.0, 5.0, 4.0, 3.0]] * 2)
    p = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[3])
    p.all_stop_token_ids.add(2)  # the engine adds the tokenizer's eos id
    md = _md([p, p], outputs=[[0], [0, 0, 0]], vocab=5)
    # Only the row short of min_tokens has the processor active.
    assert [type(p).__name__ for p in md.processors.before_penalties] == \
        ["MinTokensLogitsProcessor"]
    assert md.processors.before_penalties[0].index[0].tolist() == [0, 0]
    out = Sampler()(logits, md)
    assert out.sampled_token_ids.tolist() == [4, 2]
    assert logits[0, 2] == 5.0  # the caller's logits are untouched


# ---------------------------------------------------------------- SamplingParams


@pytest.mark.parametrize(
    "field,value",
    [
        ("n", 0),
        ("temperature", -0.1),
        ("temperature", math.nan),
        ("top_p", 0.0),
        ("top_p", 1.1),
        ("top_k", -2),
        ("top_k", 2.5),
        ("min_p", 1.5),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3.0),
        ("repetition_penalty", 0.0),
        ("max_tokens", 0),
        ("min_tokens", -1),
        ("logprobs", -2),  # -1 is the whole vocabulary (vLLM)
        ("prompt_logprobs", -2),
        ("stop", [""]),
        ("stop_token_ids", [-1]),
    ],
)
def test_sampling_params_validation_names_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_min_tokens_above_max_tokens_rejected():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=10, max_tokens=5)


def test_sampling_params_normalisation():
    p = SamplingParams(temperature=0.0, top_p=0.5, top_k=10)
    assert (p.top_p, p.top_k, p.min_p) == (1.0, -1, 0.0)
    assert SamplingParams(top_k=0).top_k == -1
    assert SamplingParams(stop="x").stop == ["x"]


# ---------------------------------------------------------------- CUDA


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_forward_has_no_sync_and_seeds_match_cpu():
    dev = torch.device("cuda")
    vocab, batch = 1000, 6
    torch.manual_seed(6)
    logits = torch.randn(batch, vocab)
    params = [
        SamplingParams(temperature=0.8, top_p=0.9, seed=11, logprobs=2),
        SamplingParams(temperature=0.0, min_tokens=4, stop_token_ids=[int(logits[1].argmax())]),
        SamplingParams(temperature=1.2, top_k=20, repetition_penalty=1.3, presence_penalty=0.5),
        SamplingParams(temperature=0.7, min_p=0.05, frequency_penalty=0.4, seed=12),
        SamplingParams(temperature=1.0, top_k=5),
        SamplingParams(temperature=0.0),
    ]
    outputs = [[1, 2, 3], [4], [5, 5], [6], [], [7]]
    prompts = [[9, 8]] * batch

    def run(device, gens):
        md = build_sampling_metadata(params, outputs, prompts, gens, vocab, device)
        x = logits.to(device)
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")  # any device->host sync raises
        try:
            out = Sampler()(x, md)
        finally:
            if device.type == "cuda":
                torch.cuda.set_sync_debug_mode("default")
        return out.sampled_token_ids.cpu(), out.logprobs

    # CPU generators used from a CUDA batch give the CPU batch's tokens on seeded rows.
    cpu_tok, _ = run(torch.device("cpu"), {0: make_generator(11), 3: make_generator(12)})
    cuda_tok, lp = run(dev, {0: make_generator(11), 3: make_generator(12)})
    assert cuda_tok[[0, 3]].tolist() == cpu_tok[[0, 3]].tolist()
    assert cuda_tok[1] != logits[1].argmax()  # min_tokens masked the stop id
    assert cuda_tok[5] == logits[5].argmax()
    assert torch.allclose(lp.logprobs.cpu(), torch.log_softmax(logits, -1).gather(
        1, lp.logprob_token_ids.cpu()), atol=1e-5)
    # CUDA generators: the same seed gives the same tokens twice.
    a, _ = run(dev, {0: make_generator(11, dev), 3: make_generator(12, dev)})
    b, _ = run(dev, {0: make_generator(11, dev), 3: make_generator(12, dev)})
    assert a[[0, 3]].tolist() == b[[0, 3]].tolist()
