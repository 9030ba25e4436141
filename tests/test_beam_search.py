"""Beam search (LLM.beam_search, AsyncLLM.beam_search) against HF transformers on tiny random
models, float32 on the CPU.

ember follows vLLM's beam search, which differs from HF's (5.x) in two rules (docs/architecture.md,
"Beam search"): vLLM's length penalty divides by prompt + generated tokens less a final eos, HF's by
the generated tokens with the eos; vLLM finishes every eos candidate of every beam's top 2k, HF
only those ranked among the step's best `num_beams`. So:

- without eos, the rules agree: same beams as `generate(num_beams=k, ...)`, and HF's
  sequences_scores equal our cum_logprob / generated_len ** length_penalty, for length penalties
  0, 1 and 2 and early_stopping "never" and False (width 1: HF's greedy search);
- with eos reached, a plain beam search over the HF model (`reference_beam_search`) is run with
  either rule set: with HF's it reproduces `generate(..., early_stopping="never")` (checking the
  reference), with vLLM's it must give ember's beams and cumulative logprobs; where both rule
  sets give the same beams, ember's are HF's too.
"""

from __future__ import annotations

import asyncio
import collections
import math
import random

import pytest
import torch
from conftest import assert_all_blocks_free, assert_all_blocks_free_async
from model_factory import make_tiny_hf_model

from ember import LLM, EngineArgs, SamplingParams
from ember.beam_search import (
    BeamSearchInstance,
    BeamSearchParams,
    get_beam_search_score,
    to_request_output,
)
from ember.outputs import CompletionOutput, Logprob, RequestOutput

ARCHS = ["llama", "qwen3"]
MAX_NEW = 8
PROMPT_LENS = (3, 7, 12)
# Weights peaky enough that next-token distributions look like a trained model's (top token
# 15-40 %), rather than nearly uniform over the vocabulary.
INIT_RANGE = 0.3


def _prompts(lens=PROMPT_LENS) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, 320) for _ in range(n)] for n in lens]


def _liked_token(hf, prompts) -> int:
    """A token often among the model's two best next tokens: as eos, beam search reaches it."""
    counts: collections.Counter[int] = collections.Counter()
    with torch.no_grad():
        for prompt in prompts:
            ids = list(prompt)
            for _ in range(MAX_NEW):
                top = torch.log_softmax(hf(torch.tensor([ids])).logits[0, -1], -1).topk(2).indices
                counts.update(top.tolist())
                ids.append(int(top[0]))
    return counts.most_common(1)[0][0]


@pytest.fixture(scope="module", params=ARCHS)
def models(request, tmp_path_factory):
    """(arch, {"plain": (hf, llm, eos, path), "eos": ...}): the same random weights saved
    without an eos token and with one the model likes as eos."""
    arch = request.param
    out = {}
    for variant in ("plain", "eos"):
        hf = make_tiny_hf_model(arch, seed=0, initializer_range=INIT_RANGE)
        eos = _liked_token(hf, _prompts()) if variant == "eos" else None
        hf.config.eos_token_id = hf.generation_config.eos_token_id = eos
        path = tmp_path_factory.mktemp(f"{arch}-{variant}") / "model"
        hf.save_pretrained(path)
        llm = LLM(str(path), skip_tokenizer_init=True, max_model_len=64)
        out[variant] = (hf, llm, hf.config.eos_token_id, str(path))
    yield arch, out
    for _, llm, _, _ in out.values():
        llm.shutdown()


def _hf_beams(hf, prompt, k, lp, early_stopping):
    """HF's beams (generated ids, eos included) and sequences_scores, best first."""
    with torch.no_grad():
        g = hf.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            num_beams=k, num_return_sequences=k, do_sample=False, max_new_tokens=MAX_NEW,
            length_penalty=lp, early_stopping=early_stopping, output_scores=True,
            return_dict_in_generate=True,
        )
    # beam_indices is -1 past a beam's last generated token: it gives each beam's length.
    lengths = (g.beam_indices != -1).sum(-1).tolist()
    seqs = [g.sequences[i, len(prompt):len(prompt) + n].tolist() for i, n in enumerate(lengths)]
    return seqs, g.sequences_scores.tolist()


def reference_beam_search(hf, prompt, k, lp, eos, rules):
    """Plain beam search over the HF model (full forward per beam): [(generated ids, cum
    logprob, score)] best first, under vLLM's rules or HF's (early_stopping="never", whose stop
    test is exact, so running to MAX_NEW changes nothing)."""
    beams = [(list(prompt), 0.0)]
    finished = []
    for step in range(MAX_NEW):
        cands = []
        for tokens, cum in beams:
            with torch.no_grad():
                logprobs = torch.log_softmax(hf(torch.tensor([tokens])).logits[0, -1].float(), -1)
            values, ids = logprobs.topk(2 * k)
            cands += [(tokens + [t], cum + v) for v, t in zip(values.tolist(), ids.tolist())]
        cands.sort(key=lambda c: c[1], reverse=True)
        if rules == "vllm":  # every eos candidate finishes
            finished += [c for c in cands if c[0][-1] == eos]
        else:  # only the step's best k candidates may finish; at the last step all of them do
            cands = cands[: 2 * k]
            last = step == MAX_NEW - 1
            finished += [c for c in cands[:k] if c[0][-1] == eos or last]
        beams = [c for c in cands if c[0][-1] != eos][:k]
    if rules == "vllm":
        finished += beams

    def score(c):
        tokens, cum = c
        if rules == "vllm":
            return get_beam_search_score(tokens, cum, eos, lp)
        return cum / (len(tokens) - len(prompt)) ** lp

    best = sorted(finished, key=score, reverse=True)[:k]
    return [(t[len(prompt):], cum, score((t, cum))) for t, cum in best]


def _ours(llm, prompts, k, lp, **kw):
    params = BeamSearchParams(beam_width=k, max_tokens=MAX_NEW, length_penalty=lp, **kw)
    outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    assert_all_blocks_free(llm)
    return [[(s.tokens[len(p):], s.cum_logprob, s) for s in o.sequences]
            for p, o in zip(prompts, outs)]


@pytest.mark.parametrize("early_stopping", ["never", False])
@pytest.mark.parametrize("lp", [1.0, 0.0, 2.0])
@pytest.mark.parametrize("k", [2, 4])
def test_same_beams_and_scores_as_hf_without_eos(models, k, lp, early_stopping):
    """A model without eos; and the same weights with an eos and ignore_eos=True."""
    _, m = models
    hf, llm, _, _ = m["plain"]
    prompts = _prompts()
    ignoring = _ours(m["eos"][1], prompts, k, lp, ignore_eos=True)
    for prompt, ours, ours_ignoring in zip(prompts, _ours(llm, prompts, k, lp), ignoring):
        hf_seqs, hf_scores = _hf_beams(hf, prompt, k, lp, early_stopping)
        for result in (ours, ours_ignoring):
            assert [t for t, _, _ in result] == hf_seqs
            assert all(s.finish_reason == "length" for _, _, s in result)
            # HF's score: cum / generated ** lp (vLLM's divides by prompt + generated).
            assert [cum / MAX_NEW**lp for _, cum, _ in result] == pytest.approx(hf_scores, abs=1e-4)


def test_width_one_is_hf_greedy_without_eos(models):
    from reference import hf_greedy

    _, m = models
    hf, llm, _, _ = m["plain"]
    prompts = _prompts()
    for prompt, ours in zip(prompts, _ours(llm, prompts, 1, 1.0)):
        ref = hf_greedy(hf, prompt, MAX_NEW, set())
        [(tokens, cum, _)] = ours
        assert tokens == ref.token_ids
        assert cum == pytest.approx(sum(top[t] for top, t in zip(ref.top5, tokens)), abs=1e-4)


@pytest.mark.parametrize("lp", [1.0, 0.0, 2.0])
@pytest.mark.parametrize("k", [2, 4])
def test_reference_with_hf_rules_is_hf_generate(models, k, lp):
    """The reference under HF's rules gives generate()'s beams and scores (eos reached)."""
    _, m = models
    hf, _, eos, _ = m["eos"]
    for prompt in _prompts():
        hf_seqs, hf_scores = _hf_beams(hf, prompt, k, lp, "never")
        ref = reference_beam_search(hf, prompt, k, lp, eos, "hf")
        assert [t for t, _, _ in ref] == hf_seqs
        assert [s for _, _, s in ref] == pytest.approx(hf_scores, abs=1e-4)


@pytest.mark.parametrize("lp", [1.0, 0.0, 2.0])
@pytest.mark.parametrize("k", [1, 2, 4])
def test_vllm_rules_with_eos(models, k, lp):
    """With eos reached, ember's beams and cumulative logprobs are the reference's under vLLM's
    rules."""
    _, m = models
    hf, llm, eos, _ = m["eos"]
    prompts = _prompts()
    stopped = 0
    for prompt, ours in zip(prompts, _ours(llm, prompts, k, lp)):
        ref = reference_beam_search(hf, prompt, k, lp, eos, "vllm")
        assert [t for t, _, _ in ours] == [t for t, _, _ in ref]
        assert [c for _, c, _ in ours] == pytest.approx([c for _, c, _ in ref], abs=1e-4)
        for tokens, _, seq in ours:
            assert seq.finish_reason == ("stop" if tokens[-1] == eos else "length")
            stopped += seq.finish_reason == "stop"
    assert stopped, "eos was never reached: the eos case tests nothing"


def test_same_as_hf_with_eos_where_the_rules_agree(models):
    """Where vLLM's and HF's rules pick the same beams (the reference says so), ember's beams
    are generate()'s and HF's scores are cum_logprob / generated_len ** length_penalty; some of
    them end in eos."""
    _, m = models
    hf, llm, eos, _ = m["eos"]
    prompts = _prompts(PROMPT_LENS + (5, 9, 16))
    compared = compared_eos = 0
    for k in (2, 4):
        for lp in (0.0, 1.0):
            for prompt, ours in zip(prompts, _ours(llm, prompts, k, lp)):
                vllm_rules = [t for t, _, _ in reference_beam_search(hf, prompt, k, lp, eos, "vllm")]
                if vllm_rules != [t for t, _, _ in reference_beam_search(hf, prompt, k, lp, eos, "hf")]:
                    continue
                hf_seqs, hf_scores = _hf_beams(hf, prompt, k, lp, "never")
                assert [t for t, _, _ in ours] == hf_seqs
                assert [c / len(t) ** lp for t, c, _ in ours] == pytest.approx(hf_scores, abs=1e-4)
                compared += 1
                compared_eos += any(t[-1] == eos for t, _, _ in ours)
    print("compared", compared, "with eos", compared_eos)
    assert compared_eos >= 1 and compared >= 8, (compared, compared_eos)


def test_batched_steps_and_concurrency_limit(models, monkeypatch):
    """Each step is one generate call holding every live beam of every prompt; with
    concurrency_limit=1 the prompts run one after another, with the same result."""
    _, m = models
    _, llm, _, _ = m["eos"]
    prompts = [{"prompt_token_ids": p} for p in _prompts()]
    params = BeamSearchParams(beam_width=4, max_tokens=5, ignore_eos=True)
    sizes: list[int] = []
    generate = llm.generate

    def counting(batch, *args, **kw):
        sizes.append(len(batch))
        return generate(batch, *args, **kw)

    monkeypatch.setattr(llm, "generate", counting)
    together = llm.beam_search(prompts, params)
    assert sizes == [3] + [12] * 4
    sizes.clear()
    one_by_one = llm.beam_search(prompts, params, concurrency_limit=1)
    assert sizes == ([1] + [4] * 4) * 3
    for a, b in zip(together, one_by_one):
        assert [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences]
        assert len(a.sequences) == 4
    assert_all_blocks_free(llm)


def test_steps_reuse_the_prompts_cached_blocks(models, monkeypatch):
    """After the first step every beam's request finds the prompt's full blocks (and those it
    shares with earlier steps) in the prefix cache: a step recomputes under a block per beam."""
    _, m = models
    _, llm, _, _ = m["plain"]
    prompt = [3 + (i * 7) % 300 for i in range(40)]  # two full 16-token blocks
    cached: list[list[int]] = []
    generate = llm.generate

    def recording(batch, *args, **kw):
        outs = generate(batch, *args, **kw)
        cached.append([o.num_cached_tokens for o in outs])
        return outs

    monkeypatch.setattr(llm, "generate", recording)
    llm.beam_search([{"prompt_token_ids": prompt}], BeamSearchParams(beam_width=2, max_tokens=12))
    # A beam of L tokens extends its parent, whose request computed the first L - 1: each
    # finds all of the parent's full blocks.
    assert cached[0] == [0]
    for step, per_beam in enumerate(cached[1:], start=1):
        assert per_beam == [(len(prompt) + step - 1) // 16 * 16] * 2, (step, per_beam)
    assert_all_blocks_free(llm)


def test_max_model_len_ends_beams(models):
    _, m = models
    _, llm, _, _ = m["plain"]
    prompt = list(range(3, 3 + 61))  # max_model_len 64: room for 3 tokens
    [out] = llm.beam_search([{"prompt_token_ids": prompt}],
                            BeamSearchParams(beam_width=2, max_tokens=10))
    assert [len(s.tokens) for s in out.sequences] == [64, 64]
    assert all(s.finish_reason == "length" for s in out.sequences)
    assert_all_blocks_free(llm)


@pytest.mark.parametrize(("field", "kw"), [
    ("beam_width", dict(beam_width=0)),
    ("beam_width", dict(beam_width=2.0)),
    ("max_tokens", dict(max_tokens=0)),
    ("temperature", dict(temperature=-0.5)),
    ("temperature", dict(temperature=math.inf)),
    ("length_penalty", dict(length_penalty=math.nan)),
    ("ignore_eos", dict(ignore_eos="yes")),
    ("include_stop_str_in_output", dict(include_stop_str_in_output=1)),
    ("structured_outputs", dict(structured_outputs={"json": {}})),
])
def test_bad_params_name_the_field(field, kw):
    base = dict(beam_width=2, max_tokens=4)
    base.update(kw)
    with pytest.raises(ValueError, match=f"BeamSearchParams.{field}"):
        BeamSearchParams(**base)


def test_bad_requests_are_refused_before_the_engine(models):
    _, m = models
    _, llm, _, _ = m["plain"]
    good = {"prompt_token_ids": [5, 6, 7]}
    with pytest.raises(ValueError, match="beam_width=11.*max_logprobs=20"):
        llm.beam_search([good], BeamSearchParams(beam_width=11, max_tokens=2))
    with pytest.raises(ValueError, match="BeamSearchParams"):
        llm.beam_search([good], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="lora_request"):
        llm.beam_search([good], BeamSearchParams(beam_width=2, max_tokens=2), lora_request=object())
    with pytest.raises(ValueError, match="concurrency_limit"):
        llm.beam_search([good], BeamSearchParams(beam_width=2, max_tokens=2), concurrency_limit=0)
    with pytest.raises(ValueError, match="empty"):
        llm.beam_search([good, {"prompt_token_ids": []}], BeamSearchParams(beam_width=2, max_tokens=2))
    with pytest.raises(ValueError, match="multi_modal_data"):
        llm.beam_search([{"prompt_token_ids": [5], "multi_modal_data": {}}],
                        BeamSearchParams(beam_width=2, max_tokens=2))
    assert_all_blocks_free(llm)


def test_temperature_adds_the_sampled_token(models, monkeypatch):
    """temperature > 0: the engine's sampled token joins each beam's 2k candidates (vLLM's);
    at 0 the sampled token is the best one, so there are exactly 2k."""
    _, m = models
    _, llm, _, _ = m["plain"]
    prompts = [{"prompt_token_ids": p} for p in _prompts()]
    sizes: list[int] = []
    generate = llm.generate

    def recording(batch, *args, **kw):
        outs = generate(batch, *args, **kw)
        sizes.extend(len(o.outputs[0].logprobs[0]) for o in outs)
        return outs

    monkeypatch.setattr(llm, "generate", recording)
    llm.beam_search(prompts, BeamSearchParams(beam_width=2, max_tokens=4))
    assert set(sizes) == {4}
    sizes.clear()
    # Near-uniform sampling over 320 tokens: ~22 draws all in the top 4 has odds ~1e-40.
    outs = llm.beam_search(prompts, BeamSearchParams(beam_width=2, max_tokens=4, temperature=100.0))
    assert set(sizes) <= {4, 5} and 5 in sizes
    assert all(len(o.sequences) == 2 for o in outs)
    assert_all_blocks_free(llm)


def test_every_field_is_tested():
    """Each BeamSearchParams field has its effect shown (or its refusal) by a test here."""
    import dataclasses

    shown_by = {
        "beam_width": test_same_beams_and_scores_as_hf_without_eos,
        "max_tokens": test_max_model_len_ends_beams,
        "ignore_eos": test_same_beams_and_scores_as_hf_without_eos,
        "temperature": test_temperature_adds_the_sampled_token,
        "length_penalty": test_vllm_rules_with_eos,
        "include_stop_str_in_output": test_eos_text_and_request_output,
        "structured_outputs": test_bad_params_name_the_field,
    }
    assert {f.name for f in dataclasses.fields(BeamSearchParams)} == set(shown_by)


# ---- eos handling without a model: fake engine outputs and tokenizer --------------------------

class _Tok:
    def decode(self, ids):
        return " ".join(f"t{i}" for i in ids)


def _step_output(candidates: dict[int, float]) -> RequestOutput:
    logprobs = [{t: Logprob(v) for t, v in candidates.items()}]
    return RequestOutput("x", None, [], [CompletionOutput(0, "", [], logprobs=logprobs)], True)


@pytest.mark.parametrize("include", [False, True])
def test_eos_text_and_request_output(include):
    params = BeamSearchParams(beam_width=2, max_tokens=2, include_stop_str_in_output=include)
    inst = BeamSearchInstance([10, 11], params, eos_ids={2}, max_model_len=64)
    assert inst.step_prompts() == [{"prompt_token_ids": [10, 11]}]
    inst.advance([_step_output({2: -0.1, 7: -1.0, 8: -2.0, 9: -3.0})])
    assert [b.tokens for b in inst.beams] == [[10, 11, 7], [10, 11, 8]]
    inst.advance([_step_output({2: -5.0, 5: -0.5}), _step_output({6: -0.2, 2: -0.3})])
    assert inst.step_prompts() == []
    out = inst.result(_Tok())
    best = out.sequences[0]
    assert best.tokens == [10, 11, 2] and best.cum_logprob == pytest.approx(-0.1)
    assert (best.finish_reason, best.stop_reason) == ("stop", 2)
    assert best.text == ("t10 t11 t2" if include else "t10 t11")
    # vLLM's score: the final eos is not counted in the length.
    assert get_beam_search_score(best.tokens, -0.1, 2, 1.0) == pytest.approx(-0.05)
    second = out.sequences[1]
    assert (second.tokens, second.finish_reason) == ([10, 11, 7, 5], "length")
    req = to_request_output("r", "p", inst, out, _Tok())
    assert req.finished and req.prompt_token_ids == [10, 11]
    assert [o.token_ids for o in req.outputs] == [[2] if include else [], [7, 5]]
    assert [o.text for o in req.outputs] == ["t2" if include else "", "t7 t5"]
    assert [o.finish_reason for o in req.outputs] == ["stop", "length"]
    assert req.outputs[1].cumulative_logprob == pytest.approx(-1.5)
    assert len(req.outputs[1].logprobs) == 2


def test_ignore_eos_keeps_eos_beams_alive():
    params = BeamSearchParams(beam_width=1, max_tokens=2, ignore_eos=True)
    inst = BeamSearchInstance([10], params, eos_ids={2}, max_model_len=64)
    inst.advance([_step_output({2: -0.1, 7: -1.0})])
    assert [b.tokens for b in inst.beams] == [[10, 2]] and not inst.completed


# ---- AsyncLLM ------------------------------------------------------------------------------------

async def _drain(gen):
    return [item async for item in gen]


def test_async_beam_search_matches_offline(models):
    from ember.engine.async_llm import AsyncLLM

    _, m = models
    _, llm, eos, path = m["eos"]
    prompts = _prompts()
    params = BeamSearchParams(beam_width=3, max_tokens=MAX_NEW, length_penalty=0.5)
    offline = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    engine = AsyncLLM(EngineArgs(model=path, skip_tokenizer_init=True, max_model_len=64))

    async def run():
        async def one(i, p):
            return [o async for o in engine.beam_search({"prompt_token_ids": p}, f"b{i}", params)]

        results = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        # Leaving early (cancelled mid-search) aborts the step's requests.
        long = BeamSearchParams(beam_width=3, max_tokens=40)
        task = asyncio.ensure_future(
            engine.beam_search({"prompt_token_ids": prompts[0]}, "left", long).__anext__())
        while not engine.output_processor.parents:  # a step's requests are in the engine
            await asyncio.sleep(0.001)
        assert task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.1)
        await assert_all_blocks_free_async(engine)
        # A failing step request (its id is taken) fails the search with its own error and
        # aborts the step's other beams.
        blocker = asyncio.ensure_future(_drain(engine.generate(
            {"prompt_token_ids": prompts[0]}, SamplingParams(max_tokens=40, ignore_eos=True),
            "dup-beam1-1")))
        with pytest.raises(ValueError, match="already in use"):
            await _drain(engine.beam_search({"prompt_token_ids": prompts[1]}, "dup", params))
        blocker.cancel()
        await asyncio.gather(blocker, return_exceptions=True)
        await asyncio.sleep(0.1)
        await assert_all_blocks_free_async(engine)
        return results

    try:
        results = asyncio.run(run())
    finally:
        engine.shutdown_sync()
    for prompt, outs, off in zip(prompts, results, offline):
        [final] = outs
        assert final.finished and final.prompt_token_ids == prompt
        assert [o.token_ids for o in final.outputs] == \
            [s.tokens[len(prompt):] if s.finish_reason == "length" else s.tokens[len(prompt):-1]
             for s in off.sequences]
        # The server batches the beams with other requests' rows, offline not: float32 sums of
        # ~10 nats differ in the sixth digit (1.06e-5 seen), the tokens not at all.
        assert [o.cumulative_logprob for o in final.outputs] == \
            pytest.approx([s.cum_logprob for s in off.sequences], abs=1e-4)
        assert [o.finish_reason for o in final.outputs] == [s.finish_reason for s in off.sequences]


def test_text_prompts_and_text(tmp_path):
    """With a tokenizer: a text prompt, `text` = prompt and generated text (vLLM's offline
    field), the async output's text = the generated text; a final eos stays out of both."""
    from text_model import PROMPT, make_text_model, text_args

    from ember.engine.async_llm import AsyncLLM

    path = make_text_model(tmp_path)
    args = text_args(path, max_model_len=128)
    llm = LLM(path, tokenizer=args.tokenizer, max_model_len=128)
    params = BeamSearchParams(beam_width=2, max_tokens=6)
    [out] = llm.beam_search([PROMPT], params)
    tokenizer = llm.get_tokenizer()
    prompt_ids = tokenizer.encode(PROMPT)
    for seq in out.sequences:
        assert seq.tokens[: len(prompt_ids)] == prompt_ids
        shown = seq.tokens[:-1] if seq.finish_reason == "stop" else seq.tokens
        assert seq.text == tokenizer.decode(shown)
    assert_all_blocks_free(llm)
    llm.shutdown()
    engine = AsyncLLM(args)

    async def run():
        return [o async for o in engine.beam_search(PROMPT, "t", params)]

    try:
        [final] = asyncio.run(run())
    finally:
        engine.shutdown_sync()
    assert final.prompt == PROMPT and final.prompt_token_ids == prompt_ids
    for o, seq in zip(final.outputs, out.sequences):
        assert o.token_ids == seq.tokens[len(prompt_ids):len(prompt_ids) + len(o.token_ids)]
        assert o.text == tokenizer.decode(o.token_ids)
