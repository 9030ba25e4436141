"""Gemma 2, Gemma 3 and Phi-3 (SDPA backend, float32, CPU) against HF transformers on the same
tiny random checkpoints, logit for logit: multi-prompt prefill, paged decode past the sliding
window, chunked prefill; LongRoPE in both regimes; what the models refuse."""

from __future__ import annotations

import pytest
import torch
from gemma_phi_factory import ARCHS, LONGROPE_ORIGINAL, make_hf_model
from model_factory import Chunk, PagedCache

from ember.attention_backends.sdpa import SdpaBackend
from ember.models.gemma2 import Gemma2ForCausalLM
from ember.models.gemma3 import Gemma3ForCausalLM, Gemma3ForConditionalGeneration
from ember.models.loader import load_config, load_model
from ember.models.phi3 import Phi3ForCausalLM

CLASSES = {"gemma2": Gemma2ForCausalLM, "gemma3": Gemma3ForCausalLM, "phi3": Phi3ForCausalLM,
           "phi3_longrope": Phi3ForCausalLM, "gemma3_mm": Gemma3ForConditionalGeneration}
ATOL = 1e-4


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """One intra-op thread: on a small shared CPU, torch's thread pool spinning against other
    processes makes these tiny matmuls up to 30x slower (float32 results are the same)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _pair(arch: str, tmp_path, max_model_len: int | None = None):
    hf = make_hf_model(arch)
    path = tmp_path / arch
    hf.save_pretrained(path, safe_serialization=True)
    config = load_config(path)
    if arch == "gemma3_mm":  # what ember.config does for a "text_config" architecture
        from ember.model_resolution import text_only_config

        config = text_only_config(config, "Gemma3ForConditionalGeneration")
    if max_model_len is not None:
        config.ember_max_model_len = max_model_len  # what ember.config sets in the engine
    model = load_model(config, CLASSES[arch], SdpaBackend, torch.float32,
                       weights=_weights(path))
    return hf, model


def _weights(path):
    from ember.models.loader import iter_safetensors, safetensors_files

    return iter_safetensors(safetensors_files(path), progress=False)


def _prompts(lengths: list[int], vocab: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


class _Runner:
    """Feeds steps to our model and checks them against HF's logits of the full sequences."""

    def __init__(self, hf, ours, seqs: list[list[int]], block_size: int = 4):
        self.ours = ours
        self.seqs = seqs
        with torch.no_grad():
            self.ref = [hf(torch.tensor([s])).logits[0].float() for s in seqs]
        self.cache = PagedCache(ours, 96, block_size, seed=1)
        self.done = [0] * len(seqs)

    def step(self, plan: dict[int, int]) -> None:
        chunks = [Chunk(r, self.seqs[r][self.done[r] : self.done[r] + n]) for r, n in plan.items()]
        logits = self.ours.compute_logits(self.cache.step(self.ours, chunks))
        row = 0
        for c in chunks:
            r, n = c.req_id, len(c.tokens)
            torch.testing.assert_close(logits[row : row + n], self.ref[r][self.done[r] :][:n],
                                       atol=ATOL, rtol=1e-4, msg=lambda m, r=r: f"req {r}: {m}")
            self.done[r] += n
            row += n


@pytest.mark.parametrize("arch", ["gemma2", "gemma3", "gemma3_mm", "phi3"])
def test_prefill_decode_and_chunks_match_hf(arch, tmp_path):
    hf, ours = _pair(arch, tmp_path)
    if arch.startswith("gemma"):  # alternating local (8-token window) and global layers
        assert ours.sliding_windows == [8, None, 8, None]
    # Below 300: ids 300-302 are the multimodal checkpoint's image tokens.
    seqs = _prompts([16, 8, 21], 300)
    run = _Runner(hf, ours, seqs)
    run.step({0: 11, 1: 5, 2: 6})  # request 2's prompt is split across two steps
    run.step({0: 1, 1: 1, 2: 15})
    for _ in range(2):  # decodes whose oldest keys have left the window
        run.step({0: 1})


def test_longrope_short_regime_matches_hf(tmp_path):
    """max_model_len within the original context: the short factors, as HF for such lengths."""
    hf, ours = _pair("phi3_longrope", tmp_path, max_model_len=LONGROPE_ORIGINAL)
    seqs = _prompts([20, LONGROPE_ORIGINAL], hf.config.vocab_size, seed=3)
    run = _Runner(hf, ours, seqs)
    run.step({0: 20, 1: LONGROPE_ORIGINAL})


def test_longrope_long_regime_matches_hf(tmp_path):
    """max_model_len past the original context: the long factors and the cos/sin scale, as HF for
    sequences longer than the original context (checked on the positions past it: HF picks the
    factors per forward pass, so a shorter prefix of the same sequence would differ)."""
    hf, ours = _pair("phi3_longrope", tmp_path, max_model_len=128)
    seqs = _prompts([LONGROPE_ORIGINAL + 9, LONGROPE_ORIGINAL + 30], hf.config.vocab_size, seed=4)
    run = _Runner(hf, ours, seqs)
    run.step({0: len(seqs[0]), 1: 20})
    run.step({1: 10})


def test_longrope_factors_differ(tmp_path):
    """The two regimes really differ on this config (else the tests above prove nothing)."""
    _, short = _pair("phi3_longrope", tmp_path, max_model_len=LONGROPE_ORIGINAL)
    _, long = _pair("phi3_longrope", tmp_path, max_model_len=128)
    a, b = short.model.rotary_emb, long.model.rotary_emb
    assert a.attention_scaling == 1.0 or a._inv_freq.tolist() != b._inv_freq.tolist()
    assert not torch.equal(a._inv_freq, b._inv_freq) and b.attention_scaling > 1.0


def test_gemma_refusals(tmp_path):
    from gemma_phi_factory import make_config

    bad_act = make_config("gemma2", hidden_activation="relu")
    with pytest.raises(ValueError, match="hidden_activation 'relu'"):
        Gemma2ForCausalLM(bad_act, SdpaBackend)
    bidir = make_config("gemma3", use_bidirectional_attention=True)
    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        Gemma3ForCausalLM(bidir, SdpaBackend)
    yarn = make_config("gemma3")
    yarn.rope_parameters["full_attention"] = {"rope_type": "yarn", "factor": 2.0,
                                              "rope_theta": 1e6}
    with pytest.raises(ValueError, match="rope_type 'yarn'"):
        Gemma3ForCausalLM(yarn, SdpaBackend)


NAMES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM", "Gemma3ForConditionalGeneration",
         "Phi3ForCausalLM")


def test_archs_are_built_in_and_listed(capsys):
    from ember.entrypoints.cli_plugins import main
    from ember.registry import ModelRegistry

    for name in NAMES:
        assert ModelRegistry.entry(name).provider.startswith("ember")
    assert set(ARCHS) >= set(CLASSES)
    assert main([]) == 0  # `ember plugins`
    out = capsys.readouterr().out
    for name in ModelRegistry.names():  # every architecture, these three included
        assert name in out


def test_unknown_architectures_get_the_list():
    from ember.registry import ModelRegistry

    with pytest.raises(ValueError, match="known architectures: .*Gemma2ForCausalLM") as info:
        ModelRegistry.resolve_architecture(["FrobnicatorForCausalLM"])
    assert all(name in str(info.value) for name in NAMES)


def test_gemma3_multimodal_checkpoint_runs_as_text(tmp_path):
    """LLM on a Gemma3ForConditionalGeneration checkpoint: its text config, its language
    model's weights (the vision tower's skipped), greedy tokens equal to HF's multimodal model
    on text prompts."""
    from reference import hf_greedy

    from ember import LLM, SamplingParams

    hf = make_hf_model("gemma3_mm")
    hf.save_pretrained(tmp_path / "mm", safe_serialization=True)
    prompts = _prompts([3, 12, 30], 300, seed=5)
    refs = [hf_greedy(hf, p, 8, {hf.config.get_text_config().eos_token_id}) for p in prompts]
    llm = LLM(str(tmp_path / "mm"), skip_tokenizer_init=True, max_model_len=64)
    assert llm.llm_engine.model_config.architecture == "Gemma3ForConditionalGeneration"
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=8))
    assert [o.outputs[0].token_ids for o in outs] == [r.token_ids for r in refs]
    llm.shutdown()
