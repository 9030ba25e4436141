"""The built-in logits processors against HF transformers' processors on random logits, the
registry and a processor registered in code, and the errors of the new SamplingParams fields.

Each check builds the sampler's metadata for a mixed batch (rows with and without the option) and
compares the processed logits row by row with what transformers' processor makes of that row.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import (
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    NoBadWordsLogitsProcessor,
    SequenceBiasLogitsProcessor,
    SuppressTokensLogitsProcessor,
)

from ember.layers.sampler import Sampler
from ember.layers.sampling_metadata import build_sampling_metadata
from ember.logits_processors import LogitsProcessor, RowState
from ember.logits_processors.validation import check_extra_args, check_logprobs
from ember.registry import LogitsProcessorRegistry, isolated
from ember.sampling_params import SamplingParams

V = 40


def _md(params, outputs=None, prompts=None):
    n = len(params)
    return build_sampling_metadata(params, outputs or [[] for _ in range(n)],
                                   prompts or [[1] for _ in range(n)], {}, V, "cpu")


def _before_penalties(logits, md):
    out = logits.clone()
    for proc in md.processors.before_penalties:
        out = proc.apply(out)
    return out


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * 3


def test_logit_bias_matches_hf_sequence_bias():
    logits = _logits(3)
    biases = [{3: 5.0, 17: -2.5, 39: 100.0}, None, {0: -100.0}]
    md = _md([SamplingParams(temperature=0.0, logit_bias=b) for b in biases])
    ours = _before_penalties(logits, md)
    for row, bias in enumerate(biases):
        ref = logits[row : row + 1].clone()
        if bias:
            hf = SequenceBiasLogitsProcessor([[[t], b] for t, b in bias.items()])
            ref = hf(torch.tensor([[1]]), ref)
        torch.testing.assert_close(ours[row : row + 1], ref)


def test_logit_bias_is_clamped_and_string_keys_are_ids():
    assert SamplingParams(logit_bias={"7": 250, 3: -1e9}).logit_bias == {7: 100.0, 3: -100.0}


def test_allowed_token_ids_matches_hf_suppress_tokens():
    logits = _logits(3, seed=1)
    allowed = [[4, 9, 30], None, [0]]
    md = _md([SamplingParams(temperature=0.0, allowed_token_ids=a) for a in allowed])
    ours = _before_penalties(logits, md)
    for row, ids in enumerate(allowed):
        ref = logits[row : row + 1].clone()
        if ids:
            ref = SuppressTokensLogitsProcessor([t for t in range(V) if t not in ids])(
                torch.tensor([[1]]), ref)
        assert torch.equal(ours[row : row + 1], ref)


def test_min_tokens_matches_hf_min_new_tokens():
    logits = _logits(4, seed=2)
    eos, stop = 2, 11
    params = [SamplingParams(temperature=0.0, min_tokens=m, stop_token_ids=[stop]) for m in
              (3, 3, 0, 5)]
    for p in params:
        p.all_stop_token_ids |= {eos, stop}  # what the engine adds (eos unless ignore_eos)
    prompt = [5, 6, 7]
    outputs = [[8], [8, 9, 10], [8], [8, 9]]
    md = _md(params, outputs, [prompt] * 4)
    ours = _before_penalties(logits, md)
    for row, (p, out) in enumerate(zip(params, outputs)):
        hf = MinNewTokensLengthLogitsProcessor(len(prompt), p.min_tokens, [eos, stop])
        ref = hf(torch.tensor([prompt + out]), logits[row : row + 1].clone())
        assert torch.equal(ours[row : row + 1], ref)


def test_bad_words_match_hf_no_bad_words():
    logits = _logits(3, seed=3)
    words = [[7], [12, 13], [20, 21, 22]]
    outputs = [[5, 12], [20, 21], [1, 2, 3]]  # 13 banned, 22 banned, only 7 banned
    params = [SamplingParams(temperature=0.0) for _ in outputs]
    for p in params:
        p._bad_words_token_ids = words  # what the front end makes of bad_words
    md = _md(params, outputs, [[30]] * 3)  # a prompt that matches no word's prefix
    ours = _before_penalties(logits, md)
    hf = NoBadWordsLogitsProcessor(words)
    for row, out in enumerate(outputs):
        ref = hf(torch.tensor([[30] + out]), logits[row : row + 1].clone())
        assert torch.equal(ours[row : row + 1], ref)
    assert math.isinf(ours[0, 13]) and math.isinf(ours[1, 22]) and not math.isinf(ours[2, 13])


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_min_p_matches_hf_min_p_warper_after_temperature(temperature):
    logits = _logits(3, seed=4)
    min_ps = [0.05, 0.0, 0.3]
    md = _md([SamplingParams(temperature=temperature, min_p=m) for m in min_ps])
    assert not md.processors.before_penalties  # min-p is argmax-invariant: after temperature
    scaled = logits / temperature
    for proc in md.processors.after_temperature:
        scaled = proc.apply(scaled)
    for row, m in enumerate(min_ps):
        ref = (logits[row : row + 1] / temperature).clone()
        if m:
            ref = MinPLogitsWarper(m)(torch.tensor([[1]]), ref)
        assert torch.equal(scaled[row : row + 1], ref)


def test_min_p_does_not_touch_greedy_rows():
    md = _md([SamplingParams(temperature=0.0, min_p=0.9)])
    assert not md.processors.after_temperature and not md.processors.before_penalties


def test_sampler_leaves_the_callers_logits_untouched():
    logits = _logits(2, seed=5)
    before = logits.clone()
    md = _md([SamplingParams(temperature=0.0, logit_bias={1: 50.0}),
              SamplingParams(temperature=0.0, allowed_token_ids=[3])])
    assert Sampler()(logits, md).sampled_token_ids.tolist() == [1, 3]
    assert torch.equal(logits, before)


# ---------------------------------------------------------------- a processor registered in code


class BanTokens(LogitsProcessor):
    """Test processor: bans the token ids given as its argument (a list)."""

    @classmethod
    def validate_params(cls, params, args, vocab_size):
        if not isinstance(args, list) or not all(isinstance(t, int) for t in args):
            raise ValueError(f"ban_tokens takes a list of token ids, got {args!r}")

    def update_state(self, rows: list[RowState], batch_size: int) -> None:
        self.pairs = [(row.index, t) for row in rows for t in row.args]

    def apply(self, logits):
        for row, token in self.pairs:
            logits[row, token] = float("-inf")
        return logits


def test_registered_processor_applies_only_to_rows_that_name_it():
    logits = _logits(2, seed=6)
    top = logits.argmax(-1).tolist()
    with isolated():
        LogitsProcessorRegistry.register_logits_processor("ban_tokens", BanTokens)
        params = [SamplingParams(temperature=0.0, extra_args={"ban_tokens": [top[0]]}),
                  SamplingParams(temperature=0.0)]
        check_extra_args(params[0], V)
        out = Sampler()(logits, _md(params)).sampled_token_ids.tolist()
        assert out[0] != top[0] and out[1] == top[1]
        with pytest.raises(ValueError, match="ban_tokens takes a list"):
            check_extra_args(SamplingParams(extra_args={"ban_tokens": "x"}), V)
    assert "ban_tokens" not in LogitsProcessorRegistry


def test_extra_args_unknown_or_builtin_names_are_refused():
    with pytest.raises(ValueError, match="extra_args.*unknown.*'nope'"):
        check_extra_args(SamplingParams(extra_args={"nope": 1}), V)
    with pytest.raises(ValueError, match="extra_args.*built-in.*'min_p'"):
        check_extra_args(SamplingParams(extra_args={"min_p": 0.1}), V)


def test_a_registered_non_processor_class_is_refused():
    with isolated():
        LogitsProcessorRegistry.register_logits_processor("not_one", dict)
        with pytest.raises(TypeError, match="not_one.*not a subclass"):
            check_extra_args(SamplingParams(extra_args={"not_one": 1}), V)


def test_builtins_are_registry_entries_owned_by_ember():
    for name in ("min_p", "min_tokens", "logit_bias", "allowed_token_ids", "bad_words"):
        entry = LogitsProcessorRegistry.entry(name)
        assert entry.builtin and entry.target.startswith("ember.logits_processors.builtin:")


# ---------------------------------------------------------------- errors name the field


@pytest.mark.parametrize("kwargs,field", [
    (dict(logit_bias={"x": 1.0}), "logit_bias"),
    (dict(logit_bias={1: float("nan")}), "logit_bias"),
    (dict(logit_bias=[1, 2]), "logit_bias"),
    (dict(allowed_token_ids=[]), "allowed_token_ids"),
    (dict(allowed_token_ids=[1.5]), "allowed_token_ids"),
    (dict(bad_words="word"), "bad_words"),
    (dict(bad_words=[1]), "bad_words"),
    (dict(extra_args=[1]), "extra_args"),
    (dict(logits_processors=[lambda ids, logits: logits]), "logits_processors"),
])
def test_sampling_params_errors_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
        SamplingParams(**kwargs)


def test_logprob_caps():
    check_logprobs(SamplingParams(logprobs=20, prompt_logprobs=20), 20, V)
    for field in ("logprobs", "prompt_logprobs"):
        with pytest.raises(ValueError, match=f"SamplingParams.{field}=21.*max_logprobs=20"):
            check_logprobs(SamplingParams(**{field: 21}), 20, V)
    check_logprobs(SamplingParams(logprobs=V), -1, V)  # -1: no cap but the vocabulary
    with pytest.raises(ValueError, match="logprobs=41.*vocabulary size 40"):
        check_logprobs(SamplingParams(logprobs=V + 1), -1, V)
    whole = SamplingParams(logprobs=-1, prompt_logprobs=-1)  # vLLM's "the whole vocabulary"
    check_logprobs(whole, -1, V)
    assert (whole.logprobs, whole.prompt_logprobs) == (V, V)
    with pytest.raises(ValueError, match="SamplingParams.logprobs=-1.*max_logprobs=20"):
        check_logprobs(SamplingParams(logprobs=-1), 20, V)
    with pytest.raises(ValueError, match="SamplingParams.logprobs must be non-negative, or -1"):
        SamplingParams(logprobs=-2)


# ---------------------------------------------------------------- CUDA


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_processors_do_not_sync_and_match_cpu():
    params = [
        SamplingParams(temperature=0.0, logit_bias={5: 50.0, 6: -3.0}),
        SamplingParams(temperature=0.0, allowed_token_ids=[1, 2, 3]),
        SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[7]),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.9, min_p=0.2, seed=3),
    ]
    params[3]._bad_words_token_ids = [[9], [4, 8]]
    outputs, logits = [[1], [2], [3], [4], [5]], _logits(5, seed=7)
    logits[2, 7] = logits[3, 8] = 30.0  # the masked tokens would win

    def greedy(device):
        md = build_sampling_metadata(params, outputs, [[0]] * 5, {}, V, device)
        x = logits.to(device)
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")  # any device->host sync raises
        try:
            sampled = Sampler()(x, md).sampled_token_ids
        finally:
            if device.type == "cuda":
                torch.cuda.set_sync_debug_mode("default")
        return sampled.cpu()[:4]  # reading the result is the one sync, outside the check

    assert greedy(torch.device("cuda")).tolist() == greedy(torch.device("cpu")).tolist()
