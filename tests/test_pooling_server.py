"""The pooling endpoints on the server, against their references.

The real all-MiniLM-L6-v2 through the official openai client (float and base64) against
sentence-transformers, and chat `messages` input against the chat template rendered by
transformers; /score, /rerank, /v1/rerank and /v2/rerank with httpx on a tiny random
cross-encoder against transformers, and /classify on it; /pooling; the refusals (wrong runner,
wrong kind, empty and too-long input, unknown fields); `ember serve` of a pooling model behind two
API servers, stopped with nothing left behind.
"""

from __future__ import annotations

import asyncio
import base64
import os
import signal
import time

import httpx
import numpy as np
import openai
import pytest
import torch
import torch.nn.functional as F
from server_utils import ServerThread
from test_pooling import SENTENCES, _tiny_bert, minilm_dir

from ember.config import EngineArgs
from ember.engine.async_llm import AsyncLLM
from ember.entrypoints.openai.api_server import build_app

NAME = "mini"
pytestmark = pytest.mark.slow  # each module fixture starts an engine-core process


class PoolingServer:
    def __init__(self, path: str, trust_request_chat_template: bool = False,
                 **engine_args) -> None:
        self.engine = AsyncLLM.from_engine_args(EngineArgs(model=path, **engine_args))
        self.app = build_app(self.engine, [NAME],
                             trust_request_chat_template=trust_request_chat_template)
        self.thread = ServerThread(self.app).start()
        self.url = self.thread.base_url

    def post(self, path: str, **body) -> httpx.Response:
        return httpx.post(self.url + path, json={"model": NAME, **body}, timeout=120)

    def stop(self) -> None:
        self.thread.stop()  # the app's lifespan shuts the engine down


@pytest.fixture(scope="module")
def st_model():
    st = pytest.importorskip("sentence_transformers")
    return st.SentenceTransformer(minilm_dir(), device="cpu")


@pytest.fixture(scope="module")
def st_reference(st_model):
    return torch.tensor(st_model.encode(SENTENCES, batch_size=4))


@pytest.fixture(scope="module")
def minilm_server():
    server = PoolingServer(minilm_dir(), trust_request_chat_template=True,
                           scheduling_policy="priority")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(minilm_server):
    with openai.OpenAI(base_url=minilm_server.url + "/v1", api_key="none", max_retries=0) as c:
        yield c


def _vector(value: list[float] | str) -> np.ndarray:
    if isinstance(value, str):
        return np.frombuffer(base64.b64decode(value), dtype="<f4")
    return np.asarray(value, dtype=np.float32)


def _error(response: httpx.Response, status: int = 400) -> dict:
    assert response.status_code == status, response.text
    return response.json()["error"]


def test_openai_client_embeddings_equal_sentence_transformers(client, st_reference):
    # Left out, encoding_format is base64 on the wire and the client decodes it; given as
    # base64, the client hands the strings over.
    for fmt in (openai.NOT_GIVEN, "base64", "float"):
        got = client.embeddings.create(model=NAME, input=SENTENCES, encoding_format=fmt,
                                       user="alice")
        vecs = torch.tensor(np.stack([_vector(d.embedding) for d in got.data]))
        assert [d.index for d in got.data] == list(range(len(SENTENCES)))
        assert F.cosine_similarity(vecs, st_reference).min() >= 0.99999
        assert got.usage.prompt_tokens == got.usage.total_tokens > len(SENTENCES)
    one = client.embeddings.create(model=NAME, input=SENTENCES[2], encoding_format="float")
    assert F.cosine_similarity(torch.tensor(one.data[0].embedding), st_reference[2], dim=0) >= 0.99999
    with pytest.raises(openai.BadRequestError, match="dimensions") as exc:
        client.embeddings.create(model=NAME, input="hello", dimensions=64)
    assert exc.value.body["param"] == "dimensions"


def test_embedding_inputs_and_fields(minilm_server, st_reference):
    server = minilm_server
    tok = server.engine.tokenizer
    ids = [tok(s)["input_ids"] for s in SENTENCES[:3]]
    for value, want in ((ids[0], [0]), (ids, [0, 1, 2])):  # token ids, one list or several
        body = server.post("/v1/embeddings", input=value).json()
        got = torch.tensor([d["embedding"] for d in body["data"]])
        assert F.cosine_similarity(got, st_reference[want]).min() >= 0.99999
    raw = server.post("/v1/embeddings", input=SENTENCES[:2], normalize=False).json()
    raw_vecs = torch.tensor([d["embedding"] for d in raw["data"]])
    assert not torch.allclose(raw_vecs.norm(dim=1), torch.ones(2))
    assert torch.allclose(F.normalize(raw_vecs, dim=1), st_reference[:2], atol=1e-5)
    plain = server.post("/v1/embeddings", input=SENTENCES[2], add_special_tokens=False).json()
    assert plain["usage"]["prompt_tokens"] == len(ids[2]) - 2  # no [CLS] / [SEP]
    cut = server.post("/v1/embeddings", input="word " * 1000, truncate_prompt_tokens=10).json()
    assert cut["usage"]["prompt_tokens"] == 10
    named = server.post("/v1/embeddings", input="x", request_id="abc").json()
    assert named["id"] == "embd-abc"
    assert server.post("/v1/embeddings", input="x", priority=-1).status_code == 200


# MiniLM has no chat template: the request brings one (the server trusts it). Roles and contents
# a line each (ended by ';', which continue_final_message leaves out), a generation prompt when
# asked, and a variable only chat_template_kwargs sets.
TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }} ;\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}"
            "{% if topic %} about {{ topic }}{% endif %}")
CHAT = [{"role": "system", "content": "You embed questions."},
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "The capital of France is"}]


def _st_on_ids(st_model, ids: list[int], normalize: bool = True) -> torch.Tensor:
    """sentence-transformers' modules (BERT, mean pooling, Normalize) on given token ids."""
    n = len(ids)
    features = {"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, n, dtype=int),
                "token_type_ids": torch.zeros(1, n, dtype=int)}
    modules = list(st_model) if normalize else list(st_model)[:2]  # [2]: Normalize
    with torch.no_grad():
        for module in modules:
            features = module(features)
    return features["sentence_embedding"][0]


def test_chat_messages_embed_the_rendered_template(minilm_server, client, st_model):
    """vLLM's EmbeddingChatRequest / PoolingChatRequest: `messages` rendered with the chat
    template as transformers renders it (each flag with its effect), embedded as
    sentence-transformers embeds those token ids."""
    from openai.types import CreateEmbeddingResponse
    from transformers import AutoTokenizer

    server = minilm_server
    tok = AutoTokenizer.from_pretrained(minilm_dir())

    def reference_ids(special: bool = False, **flags) -> list[int]:
        text = tok.apply_chat_template(CHAT, chat_template=TEMPLATE, tokenize=False, **flags)
        return tok(text, add_special_tokens=special)["input_ids"]

    # vLLM's defaults: no generation prompt, no special tokens; the official client's post()
    plain = client.post("/embeddings", cast_to=CreateEmbeddingResponse,
                        body={"model": NAME, "messages": CHAT, "chat_template": TEMPLATE,
                              "user": "alice", "encoding_format": "float"})
    ids = reference_ids()
    assert plain.usage.prompt_tokens == len(ids)
    assert F.cosine_similarity(torch.tensor(plain.data[0].embedding), _st_on_ids(st_model, ids),
                               dim=0) >= 0.99999
    cases = [  # (endpoint, request fields, the reference's token ids)
        ("/pooling", {"add_generation_prompt": True, "add_special_tokens": True,
                      "chat_template_kwargs": {"topic": "geography"},
                      "encoding_format": "base64", "request_id": "c1", "priority": -1},
         reference_ids(True, add_generation_prompt=True, topic="geography")),
        ("/v1/embeddings", {"continue_final_message": True},
         reference_ids(continue_final_message=True)),
        ("/v1/embeddings", {"truncate_prompt_tokens": 5}, ids[-5:]),  # keeps the last tokens
    ]
    seen = [ids]
    for path, fields, want in cases:
        body = server.post(path, messages=CHAT, chat_template=TEMPLATE, **fields).json()
        item = body["data"][0]
        got = torch.tensor(_vector(item.get("embedding", item.get("data"))))
        assert body["usage"]["prompt_tokens"] == len(want), (fields, body)
        assert F.cosine_similarity(got, _st_on_ids(st_model, want), dim=0) >= 0.99999, fields
        assert want not in seen, fields  # every flag changed what was embedded
        seen.append(want)
    assert server.post("/pooling", messages=CHAT, chat_template=TEMPLATE,
                       request_id="c1").json()["id"] == "pool-c1"
    raw = server.post("/v1/embeddings", messages=CHAT, chat_template=TEMPLATE,
                      normalize=False).json()["data"][0]["embedding"]
    assert torch.allclose(torch.tensor(raw), _st_on_ids(st_model, ids, normalize=False),
                          atol=1e-4)
    # refusals, each naming its field
    for fields, param in (({"add_generation_prompt": True, "continue_final_message": True},
                           "continue_final_message"),
                          ({"input": "x"}, "input"), ({"dimensions": 8}, "dimensions"),
                          ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
                          ({"use_activation": True}, "use_activation")):
        err = _error(server.post("/v1/embeddings", messages=CHAT, chat_template=TEMPLATE,
                                 **fields))
        assert err["param"] == param, (fields, err)
    for name in ("use_activation", "activation"):  # /pooling takes them; an embedder refuses
        err = _error(server.post("/pooling", messages=CHAT, chat_template=TEMPLATE,
                                 **{name: False}))
        assert err["param"] == "use_activation" and "embed" in err["message"], err
    err = _error(server.post("/v1/embeddings", messages=CHAT))  # no template anywhere
    assert err["param"] == "messages" and "chat template" in err["message"]
    assert _error(server.post("/pooling", messages=[]))["param"] == "messages"
    ctx = server.app.state.ctx
    ctx.trust_request_chat_template = False
    try:
        err = _error(server.post("/pooling", messages=CHAT, chat_template=TEMPLATE))
        assert err["param"] == "chat_template" and "--trust-request-chat-template" in err[
            "message"]
    finally:
        ctx.trust_request_chat_template = True


def test_metrics_count_pooling_requests(minilm_server):
    from server_utils import metric, parse_metrics

    def scrape() -> tuple[float, float]:
        values = parse_metrics(httpx.get(minilm_server.url + "/metrics").text)
        return (metric(values, "ember:request_success_total", finished_reason="stop"),
                metric(values, "ember:prompt_tokens_total"))

    done, tokens = scrape()
    body = minilm_server.post("/v1/embeddings", input=SENTENCES[:3]).json()
    assert scrape() == (done + 3, tokens + body["usage"]["prompt_tokens"])


def test_bad_input_is_a_clear_400(minilm_server):
    server = minilm_server
    err = _error(server.post("/v1/embeddings", input="word " * 1000))
    assert "max_model_len=256" in err["message"] and "truncate_prompt_tokens" in err["message"]
    assert err["code"] == "context_length_exceeded"
    err = _error(server.post("/v1/embeddings", input="word " * 100_000))  # refused untokenized
    assert "max_model_len=256" in err["message"]
    for empty in ("", [], [""], [[]]):
        assert "empty" in _error(server.post("/v1/embeddings", input=empty))["message"]
    err = _error(server.post("/v1/embeddings", input=[10**7]))
    assert "vocabulary" in err["message"]
    assert _error(server.post("/v1/embeddings", input="x", messages=[]))["param"] == "messages"
    assert _error(server.post("/v1/embeddings", input="x", use_activation=True))["param"] == (
        "use_activation")
    err = _error(server.post("/v1/embeddings", input="x", truncate_prompt_tokens=1000))
    assert "max_model_len" in err["message"] and err["param"] == "truncate_prompt_tokens"
    assert _error(server.post("/v1/embeddings", input="x", model="other"), 404)["param"] == (
        "model")
    for path, body in (("/v1/completions", {"prompt": "hi"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        err = _error(server.post(path, **body))
        assert "runner 'pooling'" in err["message"] and err["code"] == "model_not_supported"
    err = _error(server.post("/classify", input="x"))
    assert "classification model" in err["message"] and "BertModel" in err["message"]
    # ...and the server still serves.
    assert server.post("/v1/embeddings", input="fine").status_code == 200
    assert server.engine.stats()["num_unfinished_requests"] == 0


def test_pooling_score_and_rerank_on_an_embedding_model(minilm_server, st_reference):
    server = minilm_server
    body = server.post("/pooling", input=SENTENCES[:2], encoding_format="base64").json()
    assert body["data"][0]["object"] == "pooling"
    assert all(isinstance(d["data"], str) for d in body["data"])
    vecs = torch.tensor(np.stack([_vector(d["data"]) for d in body["data"]]))
    assert F.cosine_similarity(vecs, st_reference[:2]).min() >= 0.99999
    scores = server.post("/score", text_1=SENTENCES[4], text_2=[SENTENCES[5], SENTENCES[14]]).json()
    want = (st_reference[4] @ st_reference[[5, 14]].T).tolist()
    assert [d["score"] for d in scores["data"]] == pytest.approx(want, abs=1e-5)
    docs = [SENTENCES[14], SENTENCES[5], SENTENCES[0]]
    ranked = server.post("/v1/rerank", query=SENTENCES[4], documents=docs, top_n=2).json()
    sims = (st_reference[4] @ st_reference[[14, 5, 0]].T).tolist()
    best = sorted(range(3), key=lambda i: sims[i], reverse=True)[:2]
    assert [r["index"] for r in ranked["results"]] == best
    assert [r["relevance_score"] for r in ranked["results"]] == pytest.approx(
        [sims[i] for i in best], abs=1e-5)
    assert ranked["results"][0]["document"] == {"text": docs[best[0]]}
    err = _error(server.post("/score", text_1="a", text_2="b", use_activation=False))
    assert err["param"] == "use_activation"


def test_async_llm_encode_and_cancelled_requests(minilm_server, st_reference):
    """vLLM's AsyncLLM.encode; a caller cancelled while its prompts are in the core leaves no
    request behind, and the engine serves on (from another event loop than the server's)."""
    from ember.pooling.params import PoolingParams

    engine = minilm_server.engine
    n = 64

    async def run() -> list:
        task = asyncio.ensure_future(engine.pool_many(
            [SENTENCES[3]] * n, [PoolingParams(task="embed")] * n, [f"gone-{i}" for i in range(n)]))
        await asyncio.sleep(0)  # sent to the core
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        with pytest.raises(ValueError, match="already in use"):
            await engine.pool_many(["a", "b"], [PoolingParams()] * 2, ["same", "same"])
        return [out async for out in engine.encode(SENTENCES[2], PoolingParams(task="embed"),
                                                   "after")]

    (out,) = asyncio.run(run())
    assert out.finished and out.request_id == "after"
    assert F.cosine_similarity(out.outputs.data, st_reference[2], dim=0) >= 0.99999
    assert engine.stats()["num_unfinished_requests"] == 0
    deadline = time.monotonic() + 30
    while engine.call_core_sync("idle_report")["has_work"]:
        assert time.monotonic() < deadline, "the core kept the cancelled requests"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory):
    hf, tok, path = _tiny_bert(tmp_path_factory.mktemp("xenc"), num_labels=1)
    server = PoolingServer(path)
    yield server, hf, tok
    server.stop()


def _logits(hf, tok, a: str, b: str | None = None) -> torch.Tensor:
    with torch.no_grad():
        enc = tok(a, b, return_tensors="pt") if b is not None else tok(a, return_tensors="pt")
        return hf(**enc).logits[0]


def test_cross_encoder_score_rerank_and_classify_match_transformers(cross_encoder):
    server, hf, tok = cross_encoder
    query, docs = SENTENCES[5], [SENTENCES[4], SENTENCES[2], SENTENCES[13], SENTENCES[0]]
    logits = torch.stack([_logits(hf, tok, query, d)[0] for d in docs])
    want = logits.sigmoid().tolist()
    got = server.post("/score", text_1=query, text_2=docs).json()
    assert [d["score"] for d in got["data"]] == pytest.approx(want, abs=1e-5)
    raw = server.post("/score", text_1=[query] * 4, text_2=docs, use_activation=False).json()
    assert [d["score"] for d in raw["data"]] == pytest.approx(logits.tolist(), abs=1e-4)
    order = sorted(range(4), key=lambda i: want[i], reverse=True)
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):  # vLLM's three spellings
        ranked = server.post(path, query=query, documents=docs).json()
        assert [r["index"] for r in ranked["results"]] == order
        assert [r["relevance_score"] for r in ranked["results"]] == pytest.approx(
            [want[i] for i in order], abs=1e-5)
        assert [r["document"]["text"] for r in ranked["results"]] == [docs[i] for i in order]
    short = server.post("/rerank", query=query, documents=docs, top_n=1,
                        return_documents=False).json()
    assert short["results"] == [{"index": order[0], "relevance_score": pytest.approx(
        want[order[0]], abs=1e-5)}]
    assert short["usage"]["prompt_tokens"] > 0
    classes = server.post("/classify", input=SENTENCES[:3]).json()
    for text, item in zip(SENTENCES[:3], classes["data"]):
        assert item["num_classes"] == 1 and item["label"] == "LABEL_0"
        assert item["probs"] == pytest.approx(_logits(hf, tok, text).sigmoid().tolist(), abs=1e-5)
    assert "text_1 has 2" in _error(server.post("/score", text_1=[query] * 2, text_2=docs))[
        "message"]
    assert _error(server.post("/rerank", query=query, documents=[]))["param"] == "documents"
    assert _error(server.post("/rerank", query=query, documents=docs, top_n=-1))["param"] == (
        "top_n")
    err = _error(server.post("/v1/embeddings", input="x"))
    assert "classification model" in err["message"]
    # vLLM's other fields: raw logits, the older activation spelling, truncation, ids, priority
    for path, body in (("/classify", {"input": SENTENCES[2]}), ("/pooling", {"input": SENTENCES[2]})):
        for off in ({"use_activation": False}, {"activation": False}):
            got = server.post(path, **body, **off).json()["data"][0]
            assert got.get("probs", got.get("data")) == pytest.approx(
                _logits(hf, tok, SENTENCES[2]).tolist(), abs=1e-4)
    full = server.post("/classify", input=SENTENCES[2]).json()["usage"]["prompt_tokens"]
    plain = server.post("/classify", input=SENTENCES[2], add_special_tokens=False).json()
    assert plain["usage"]["prompt_tokens"] == full - 2
    for path, body in (("/classify", {"input": [SENTENCES[3]] * 2}),
                       ("/score", {"text_1": query, "text_2": [SENTENCES[3]] * 2}),
                       ("/rerank", {"query": query, "documents": [SENTENCES[3]] * 2})):
        cut = server.post(path, **body, truncate_prompt_tokens=6, request_id="r1").json()
        assert cut["usage"]["prompt_tokens"] == 12 and cut["id"].endswith("-r1"), cut
        err = _error(server.post(path, **body, priority=1))
        assert err["param"] == "priority" and "scheduling_policy" in err["message"]


def test_pooling_core_honours_priority():
    from ember.core.messages import EngineCoreRequest
    from ember.pooling.core import PoolingEngineCore
    from ember.pooling.params import PoolingParams
    from ember.sampling_params import SamplingParams

    core = PoolingEngineCore(EngineArgs(model=minilm_dir(), scheduling_policy="priority",
                                        max_num_seqs=1))
    for i, prio in enumerate((5, -1, 3)):
        core.add_request(EngineCoreRequest(f"r{i}", [101, 2000 + i, 102], SamplingParams(), [],
                                           float(i), priority=prio,
                                           pooling_params=PoolingParams(task="embed")))
    order = [core.step().outputs[0].request_id for _ in range(3)]
    assert order == ["r1", "r2", "r0"]


def test_serve_pooling_model_two_api_servers_and_clean_exit(tmp_path, st_reference):
    from test_server_processes import Serve

    serve = Serve(tmp_path, minilm_dir(), "--api-server-count", "2",
                  "--hf-overrides", '{"matryoshka_dimensions": [64, 128]}')
    try:
        serve.wait_healthy()
        for _ in range(4):  # a new connection each: both API servers answer some
            with serve.client() as c:
                got = c.embeddings.create(model="smol", input=SENTENCES[:4])
                cut = c.embeddings.create(model="smol", input=SENTENCES[:4], dimensions=64)
            vecs = torch.tensor([d.embedding for d in got.data])
            assert F.cosine_similarity(vecs, st_reference[:4]).min() >= 0.99999
            # Matryoshka: the first 64 values, normalized again (sentence-transformers' way)
            short = torch.tensor([d.embedding for d in cut.data])
            want = F.normalize(st_reference[:4, :64], dim=1)
            assert short.shape == (4, 64) and F.cosine_similarity(short, want).min() >= 0.99999
    finally:
        serve.stop_and_check_no_orphans()
    assert serve.proc.returncode == 0


def test_classifier_with_three_labels(tmp_path):
    import json

    hf, tok, path = _tiny_bert(tmp_path, num_labels=3)
    config_path = f"{path}/config.json"
    with open(config_path) as f:
        config = json.load(f)
    config["id2label"] = {"0": "negative", "1": "neutral", "2": "positive"}
    config["label2id"] = {v: int(k) for k, v in config["id2label"].items()}
    with open(config_path, "w") as f:
        json.dump(config, f)
    server = PoolingServer(path)
    try:
        got = server.post("/classify", input=SENTENCES[:4]).json()
        for text, item in zip(SENTENCES[:4], got["data"]):
            want = _logits(hf, tok, text).softmax(-1)
            assert item["probs"] == pytest.approx(want.tolist(), abs=1e-5)
            assert item["num_classes"] == 3
            assert item["label"] == config["id2label"][str(int(want.argmax()))]
        for path_, body in (("/score", {"text_1": "a", "text_2": "b"}),
                            ("/rerank", {"query": "a", "documents": ["b"]})):
            err = _error(server.post(path_, **body))
            assert "3 labels" in err["message"] and err["code"] == "model_not_supported"
        # A dead engine core: pooling requests are 503s, not hangs
        os.kill(server.engine.client.address.pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while httpx.get(server.url + "/health").status_code != 503:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        err = _error(server.post("/classify", input="x"), 503)
        assert "engine core" in err["message"]
    finally:
        server.stop()


POOLING_PATHS = ["/v1/embeddings", "/pooling", "/classify", "/score", "/v1/score", "/rerank",
                 "/v1/rerank"]


@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_generated_requests_never_get_a_5xx(minilm_server, mode):
    """Schemathesis on the pooling endpoints of a pooling model (valid requests reach the
    engine core), unpaired surrogates mixed into the strings as in test_server_schema."""
    schemathesis = pytest.importorskip("schemathesis")
    import json

    import requests
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
    from test_server_schema import _add_surrogates

    schema = schemathesis.openapi.from_url(minilm_server.url + "/openapi.json")
    for path in POOLING_PATHS:
        strategy = schema[path]["POST"].as_strategy(schemathesis.GenerationMode(mode))

        @given(case=strategy, data=st.data())
        @settings(max_examples=8, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        def check(case, data) -> None:
            kwargs = case.as_transport_kwargs()
            if isinstance(case.body, (dict, list, str)):
                kwargs.pop("json", None)
                kwargs["data"] = json.dumps(_add_surrogates(case.body, data)).encode()
                kwargs.setdefault("headers", {})["Content-Type"] = "application/json"
            response = requests.request(**kwargs, timeout=120)
            assert response.status_code < 500, (case.path, case.body, response.text[:500])

        check()
    assert minilm_server.engine.stats()["num_unfinished_requests"] == 0
