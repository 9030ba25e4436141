"""Logits processing through the whole engine, checked against HF transformers' processors.

Greedy decoding of tiny random checkpoints with logit_bias, allowed_token_ids, min_tokens and
bad_words (and a processor registered in code, and one installed as an entry-point plugin) must
give exactly the token ids of HF's model with the matching HF logits processors, one request at a
time, while ember runs them batched beside requests without processing, under async scheduling,
chunked prefill, n > 1 and prefix caching. Errors of the new options are ValueErrors naming them.
"""

from __future__ import annotations

import json
import random

import pytest
import torch
from conftest import assert_all_blocks_free
from model_factory import make_tiny_model
from plugin_utils import run_py, write_plugin
from transformers import (
    AutoModelForCausalLM,
    MinNewTokensLengthLogitsProcessor,
    NoBadWordsLogitsProcessor,
    SequenceBiasLogitsProcessor,
    SuppressTokensLogitsProcessor,
)

from ember import LLM, EngineArgs, SamplingParams
from ember.logits_processors import LogitsProcessor, RowState
from ember.logits_processors.validation import bad_words_token_ids
from ember.registry import LogitsProcessorRegistry, isolated

MAX_NEW = 12
EOS = 2  # tiny models' eos_token_id


def hf_greedy_with(model, prompt: list[int], processors, stop_ids=(EOS,), max_new=MAX_NEW):
    """HF's model, greedy, with HF logits processors applied to each step's scores."""
    out: list[int] = []
    with torch.inference_mode():
        for _ in range(max_new):
            ids = torch.tensor([prompt + out])
            scores = model(input_ids=ids).logits[:, -1].float()
            for proc in processors:
                scores = proc(ids, scores)
            out.append(int(scores.argmax()))
            if out[-1] in stop_ids:
                break
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = str(make_tiny_model("llama", tmp_path_factory.mktemp("lp-llama")))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 320) for _ in range(n)] for n in (3, 9, 17, 6)]
    return path, hf, prompts


def _tokens(llm, prompts, params) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert_all_blocks_free(llm)
    return [list(c.token_ids) for o in outs for c in o.outputs]


ENGINES = {
    "default": dict(),
    "async_scheduling": dict(async_scheduling=True),
    "chunked_prefill": dict(max_num_batched_tokens=8, enable_prefix_caching=False),
}


@pytest.mark.parametrize("engine", list(ENGINES))
def test_builtins_match_hf_greedy(tiny, engine):
    path, hf, prompts = tiny
    llm = LLM(path, skip_tokenizer_init=True, max_model_len=96, block_size=4, **ENGINES[engine])
    plain = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
    base = _tokens(llm, prompts, plain)
    rng = random.Random(3)
    allowed = sorted(rng.sample(range(320), 12))
    # Per prompt: (ember params, HF processors); each option must change that prompt's output.
    bias = {base[0][1]: -100.0, base[0][4]: -7.5, 77: 4.0}
    cases = [
        (dict(logit_bias=bias), [SequenceBiasLogitsProcessor([[[t], b] for t, b in bias.items()])]),
        (dict(allowed_token_ids=allowed),
         [SuppressTokensLogitsProcessor([t for t in range(320) if t not in allowed])]),
        (dict(min_tokens=6, stop_token_ids=[base[2][1]]),
         [MinNewTokensLengthLogitsProcessor(len(prompts[2]), 6, [EOS, base[2][1]])]),
        (dict(min_tokens=4, allowed_token_ids=allowed + [EOS], logit_bias={EOS: 100.0}),
         [SuppressTokensLogitsProcessor([t for t in range(320) if t not in allowed + [EOS]]),
          SequenceBiasLogitsProcessor([[[EOS], 100.0]]),
          MinNewTokensLengthLogitsProcessor(len(prompts[3]), 4, [EOS])]),
    ]
    params = [SamplingParams(temperature=0.0, max_tokens=MAX_NEW, **kw) for kw, _ in cases]
    # Every request beside an unprocessed twin of itself: its rows must stay untouched.
    ours = _tokens(llm, prompts + prompts, params + [plain] * len(prompts))
    for i, (prompt, (_, procs)) in enumerate(zip(prompts, cases)):
        stop = {EOS} | set(params[i].stop_token_ids)
        assert ours[i] == hf_greedy_with(hf, prompt, procs, stop), f"case {i}"
        assert ours[i] != base[i], f"case {i} had no effect"
        assert ours[len(prompts) + i] == base[i]
    assert EOS not in ours[3][:4] and ours[3][4:] == [EOS]  # min_tokens held back the biased eos


def test_min_p_one_keeps_only_the_top_token(tiny):
    path, hf, prompts = tiny
    llm = LLM(path, skip_tokenizer_init=True, max_model_len=96)
    params = SamplingParams(temperature=1.0, min_p=1.0, seed=5, max_tokens=MAX_NEW)
    for prompt, ours in zip(prompts, _tokens(llm, prompts, params)):
        assert ours == hf_greedy_with(hf, prompt, [])


# ---------------------------------------------------------------- a processor registered in code


class NoRepeat(LogitsProcessor):
    """Test processor: bans each row's last generated token (reads token values, so the runner
    must wait for the step in flight under async scheduling)."""

    needs_output_tokens = True

    @classmethod
    def is_active(cls, params, args, num_output_tokens):
        return num_output_tokens > 0

    def update_state(self, rows: list[RowState], batch_size: int) -> None:
        self.rows = torch.tensor([row.index for row in rows])
        self.last = torch.tensor([row.output_token_ids[-1] for row in rows])
        assert int(self.last.min()) >= 0, "a placeholder reached a processor that reads tokens"

    def apply(self, logits):
        logits[self.rows, self.last] = float("-inf")
        return logits


def _hf_no_repeat(prompt_len: int):
    def proc(ids, scores):
        if ids.shape[1] > prompt_len:
            scores[0, ids[0, -1]] = float("-inf")
        return scores
    return proc


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_registered_processor_selected_by_name_matches_hf(tiny, async_scheduling):
    path, hf, prompts = tiny
    with isolated():
        LogitsProcessorRegistry.register_logits_processor("no_repeat", NoRepeat)
        llm = LLM(path, skip_tokenizer_init=True, max_model_len=96,
                  async_scheduling=async_scheduling)
        selected = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, extra_args={"no_repeat": {}})
        plain = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
        ours = _tokens(llm, prompts + prompts, [selected] * len(prompts) + [plain] * len(prompts))
        changed = 0
        for i, prompt in enumerate(prompts):
            assert ours[i] == hf_greedy_with(hf, prompt, [_hf_no_repeat(len(prompt))])
            assert all(a != b for a, b in zip(ours[i], ours[i][1:]))
            assert ours[len(prompts) + i] == hf_greedy_with(hf, prompt, [])
            changed += ours[i] != ours[len(prompts) + i]
        assert changed  # the tiny model repeats tokens without it
        with pytest.raises(ValueError, match="extra_args.*unknown.*'no_such'"):
            llm.generate({"prompt_token_ids": prompts[0]},
                         SamplingParams(extra_args={"no_such": 1}), use_tqdm=False)


def test_registered_processor_reaches_an_engine_core_process(tiny, monkeypatch):
    path, hf, prompts = tiny
    monkeypatch.setenv("EMBER_ENGINE_PROCESS", "1")
    with isolated():
        LogitsProcessorRegistry.register_logits_processor("no_repeat", NoRepeat)
        llm = LLM(path, skip_tokenizer_init=True, max_model_len=96, num_gpu_blocks_override=64)
        try:
            assert llm.llm_engine.client.multiprocess
            params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW,
                                    extra_args={"no_repeat": None}, logit_bias={77: 2.0})
            ours = _tokens(llm, prompts[:2], params)
        finally:
            llm.shutdown()
    bias = SequenceBiasLogitsProcessor([[[77], 2.0]])
    for prompt, tokens in zip(prompts, ours):
        assert tokens == hf_greedy_with(hf, prompt, [_hf_no_repeat(len(prompt)), bias])


def test_plugin_entry_point_adds_a_processor(tiny, tmp_path):
    path, hf, prompts = tiny
    write_plugin(tmp_path, "lp-plugin", {"lpp": "lpp_plugin"}, {
        "lpp_plugin": """
            from ember.plugins import hookimpl

            @hookimpl
            def ember_register_logits_processors(registry):
                registry.register_logits_processor("only_token", "lpp_impl:OnlyToken")
        """,
        "lpp_impl": """
            import torch
            from ember.logits_processors import LogitsProcessor

            class OnlyToken(LogitsProcessor):
                def update_state(self, rows, batch_size):
                    self.rows = [(row.index, int(row.args)) for row in rows]

                def apply(self, logits):
                    for row, token in self.rows:
                        keep = logits[row, token].clone()
                        logits[row] = float("-inf")
                        logits[row, token] = keep
                    return logits
        """})
    proc = run_py(f"""
        import json
        from ember import LLM, SamplingParams
        from ember.entrypoints.cli_plugins import listing_and_status
        lines, ok = listing_and_status()
        llm = LLM({path!r}, skip_tokenizer_init=True, max_model_len=96)
        prompt = {{"prompt_token_ids": {prompts[0]!r}}}
        out = llm.generate([prompt, prompt], [
            SamplingParams(temperature=0, max_tokens=5, extra_args={{"only_token": 42}}),
            SamplingParams(temperature=0, max_tokens=5)], use_tqdm=False)
        print(json.dumps([ok, lines, [list(o.outputs[0].token_ids) for o in out]]))
    """, path=[tmp_path], EMBER_PLUGINS="lpp")
    ok, lines, (forced, plain) = json.loads(proc.stdout.strip().splitlines()[-1])
    assert ok and any("Logits processors" in line for line in lines)
    assert any("only_token" in line and "lp-plugin" in line for line in lines)
    assert forced == [42] * 5
    assert plain == hf_greedy_with(hf, prompts[0], [], max_new=5)


# ---------------------------------------------------------------- bad_words (needs a tokenizer)


@pytest.fixture(scope="module")
def text_model(tmp_path_factory):
    from ember.default_model import default_model_path
    from ember.tokenizer import load_tokenizer

    path = str(make_tiny_model("llama", tmp_path_factory.mktemp("lp-text"), vocab_size=49152,
                               eos_token_id=0))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer_path = default_model_path()
    return path, hf, tokenizer_path, load_tokenizer(tokenizer_path)


@pytest.mark.parametrize("variant", ["default", "async_scheduling", "n2_prefix_cache"])
def test_bad_words_match_hf_no_bad_words(text_model, variant):
    path, hf, tokenizer_path, tok = text_model
    kw = dict(async_scheduling=True) if variant == "async_scheduling" else {}
    llm = LLM(path, tokenizer=tokenizer_path, max_model_len=128, block_size=4, **kw)
    prompt = "The quick brown fox jumps over the lazy dog and"
    prompt_ids = tok.encode(prompt)
    plain = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    base = llm.generate(prompt, plain, use_tqdm=False)[0].outputs[0].token_ids
    # A two-token word from the model's own output, and a one-token word it would say first.
    words = [tok.decode(base[2:4]), tok.decode(base[:1])]
    sequences = bad_words_token_ids(words, tok, 49152)
    assert all(list(prompt_ids[-len(s) + 1:]) != s[:-1] for s in sequences if len(s) > 1), \
        "HF also matches a word's prefix against the prompt; ember (vLLM) against the output"
    n = 2 if variant == "n2_prefix_cache" else 1
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True,
                            bad_words=words, n=n)
    outs = llm.generate([prompt, prompt], [params, plain], use_tqdm=False)
    ref = hf_greedy_with(hf, prompt_ids, [NoBadWordsLogitsProcessor(sequences)], stop_ids=())
    assert [list(c.token_ids) for c in outs[0].outputs] == [ref] * n
    assert ref != list(base) and list(outs[1].outputs[0].token_ids) == list(base)
    assert_all_blocks_free(llm)


def test_bad_words_tokenization_follows_vllm(text_model):
    _, _, _, tok = text_model
    seqs = bad_words_token_ids(["  hello world"], tok, 49152)
    assert seqs[0] == tok.encode("hello world", add_special_tokens=False)
    spaced = tok.encode(" hello world", add_special_tokens=False)
    assert (spaced in seqs) == (spaced[0] != seqs[0][0] and len(spaced) == len(seqs[0]))
    with pytest.raises(ValueError, match="SamplingParams.bad_words.*no tokens"):
        bad_words_token_ids([""], tok, 49152)


# ---------------------------------------------------------------- errors name the field


def test_engine_errors_name_the_field(tiny):
    path, _, prompts = tiny
    llm = LLM(path, skip_tokenizer_init=True, max_model_len=96)
    prompt = {"prompt_token_ids": prompts[0]}
    cases = [
        (dict(logprobs=100000), "SamplingParams.logprobs=100000.*max_logprobs=20"),
        (dict(prompt_logprobs=21), "SamplingParams.prompt_logprobs=21.*max_logprobs=20"),
        (dict(logit_bias={320: 1.0}), r"SamplingParams.logit_bias.*vocabulary.*\[320\]"),
        (dict(allowed_token_ids=[5, -1]), r"SamplingParams.allowed_token_ids.*\[-1\]"),
        (dict(bad_words=["x"]), "SamplingParams.bad_words needs a tokenizer"),
        (dict(extra_args={"nope": 1}), "SamplingParams.extra_args.*'nope'"),
    ]
    for kwargs, match in cases:
        with pytest.raises(ValueError, match=match):
            llm.generate(prompt, SamplingParams(max_tokens=2, **kwargs), use_tqdm=False)
    out = llm.generate(prompt, SamplingParams(max_tokens=2, logprobs=20), use_tqdm=False)
    assert len(out[0].outputs[0].logprobs[0]) >= 20


def test_max_logprobs_engine_argument(tiny):
    path, _, prompts = tiny
    llm = LLM(path, skip_tokenizer_init=True, max_model_len=96, max_logprobs=3)
    prompt = {"prompt_token_ids": prompts[0]}
    llm.generate(prompt, SamplingParams(max_tokens=1, logprobs=3, prompt_logprobs=3),
                 use_tqdm=False)
    with pytest.raises(ValueError, match="SamplingParams.logprobs=4.*max_logprobs=3"):
        llm.generate(prompt, SamplingParams(max_tokens=1, logprobs=4), use_tqdm=False)
    unlimited = LLM(path, skip_tokenizer_init=True, max_model_len=96, max_logprobs=-1)
    out = unlimited.generate(prompt, SamplingParams(max_tokens=1, logprobs=100), use_tqdm=False)
    assert len(out[0].outputs[0].logprobs[0]) >= 100
    whole = unlimited.generate(prompt, SamplingParams(max_tokens=2, logprobs=-1, prompt_logprobs=-1),
                               use_tqdm=False)[0]
    assert all(len(pos) == 320 for pos in whole.outputs[0].logprobs)  # the whole vocabulary
    assert all(len(pos) == 320 for pos in whole.prompt_logprobs[1:])
    with pytest.raises(ValueError, match="SamplingParams.logprobs=-1.*max_logprobs=3"):
        llm.generate(prompt, SamplingParams(max_tokens=1, logprobs=-1), use_tqdm=False)
    with pytest.raises(ValueError, match="max_logprobs"):
        EngineArgs(max_logprobs=-2).validate()
