"""Client mistakes get OpenAI-style errors with the right status (400, 401, 404, 400 for too
long), never a 500, and the server keeps serving; a crashed engine answers 503.
"""

from __future__ import annotations

import httpx
import openai
import pytest
from model_factory import make_tiny_model
from server_utils import API_KEY, MODEL_NAME, ServerThread

from ember import EngineArgs
from ember.engine.async_llm import AsyncLLM

CHAT = [{"role": "user", "content": "Hi"}]



def _check_body(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


BAD_COMPLETIONS = [
    ({"prompt": "x", "temperature": -1}, "temperature"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "n": 129}, "n"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "presence_penalty": 3}, "presence_penalty"),
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 4, "min_tokens": 5}, "min_tokens"),  # SamplingParams' check
    ({"prompt": "x", "stop": [""]}, "stop"),
    ({"prompt": "x", "stop_token_ids": [10**9]}, "stop_token_ids"),
    ({"prompt": "x", "seed": 2**70}, "seed"),
    ({"prompt": "x", "logit_bias": {"one": 5}}, "logit_bias"),
    ({"prompt": "x", "best_of": 3}, "best_of"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [5, -1]}, "prompt"),
    ({"prompt": [[5, 10**8]]}, "prompt"),
    ({}, "prompt"),
]


@pytest.mark.parametrize("body,param", BAD_COMPLETIONS, ids=[p for _, p in BAD_COMPLETIONS])
def test_completion_400(server, body, param):
    response = httpx.post(server.base_url + "/v1/completions", json={"model": MODEL_NAME, **body})
    error = _check_body(response, 400)
    assert param in (error["param"] or "") or param in error["message"]


BAD_CHATS = [
    {"messages": []},
    {"messages": [{"role": "wizard", "content": "x"}]},
    {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
    {"messages": CHAT, "top_logprobs": 2},
    {"messages": CHAT, "logprobs": True, "top_logprobs": 50},
    {"messages": CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]},
    {"messages": CHAT, "response_format": {"type": "yaml"}},
    {"messages": CHAT, "temperature": "hot"},
]


@pytest.mark.parametrize("body", BAD_CHATS)
def test_chat_400(server, body):
    response = httpx.post(server.base_url + "/v1/chat/completions",
                          json={"model": MODEL_NAME, **body})
    _check_body(response, 400)


def test_malformed_json_and_unknown_route(server):
    url = server.base_url
    response = httpx.post(url + "/v1/completions", content=b"{not json",
                          headers={"content-type": "application/json"})
    _check_body(response, 400)
    _check_body(httpx.get(url + "/v1/nothing-here"), 404)
    _check_body(httpx.get(url + "/v1/completions"), 405)


def test_openai_client_exceptions(client):
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL_NAME, prompt="x", temperature=-2)
    with pytest.raises(openai.NotFoundError) as exc:
        client.completions.create(model="no-such-model", prompt="x")
    assert exc.value.body["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=CHAT)
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    with pytest.raises(openai.BadRequestError, match="embeddings"):
        client.embeddings.create(model=MODEL_NAME, input="hello")
    # ...and the server still serves.
    out = client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=2)
    assert out.usage.completion_tokens >= 1


def test_prompt_too_long(server, client):
    long_prompt = " word" * 1500  # > max_model_len=1024 tokens
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=MODEL_NAME, prompt=long_prompt, max_tokens=4)
    assert exc.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.chat.completions.create(model=MODEL_NAME, stream=True,
                                       messages=[{"role": "user", "content": long_prompt}])
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=5000)
    assert httpx.get(server.base_url + "/health").status_code == 200


def test_api_key(server):
    keyed = server.keyed.base_url
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        error = _check_body(httpx.get(keyed + "/v1/models", headers=headers), 401)
        assert error["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=keyed + "/v1", api_key="nope", max_retries=0).models.list()
    good = openai.OpenAI(base_url=keyed + "/v1", api_key=API_KEY, max_retries=0)
    assert good.models.list().data[0].id == MODEL_NAME
    out = good.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=2)
    assert out.usage.completion_tokens >= 1
    assert httpx.get(keyed + "/health").status_code == 200  # outside /v1: open


def test_crashed_engine_answers_503(tmp_path):
    from ember.entrypoints.openai.api_server import build_app

    path = make_tiny_model("llama", tmp_path)
    engine = AsyncLLM.from_engine_args(
        EngineArgs(model=str(path), skip_tokenizer_init=True, num_gpu_blocks_override=64))

    engine.call_core_sync("inject_step_failure", "kernel exploded")
    srv = ServerThread(build_app(engine, ["tiny"])).start()
    try:
        url = srv.base_url
        assert httpx.get(url + "/health").status_code == 200
        body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 3}
        error = _check_body(httpx.post(url + "/v1/completions", json=body), 503)
        assert "kernel exploded" in error["message"]
        _check_body(httpx.get(url + "/health"), 503)
        with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}) as r:
            assert r.status_code == 503  # dead before the stream starts: a plain error
    finally:
        srv.stop()


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", '{"model": "smol", "prompt": "a\\ud800b", "max_tokens": 2}'),
    ("/v1/completions", '{"model": "smol", "prompt": ["ok", "\\udfff"], "max_tokens": 2}'),
    ("/v1/completions", '{"model": "smol", "prompt": "\\ud800", "max_tokens": 2, "stream": true}'),
    ("/v1/completions", '{"model": "\\ud800", "prompt": "hi", "max_tokens": 2}'),
    ("/tokenize", '{"model": "smol", "prompt": "x\\ud800"}'),
])
def test_unpaired_surrogates_are_400_and_the_connection_lives(server, path, body):
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        response = client.post(path, content=body, headers={"content-type": "application/json"})
        assert response.status_code in (400, 404), response.text
        error = response.json()["error"]
        assert "surrogate" in error["message"] and "Traceback" not in error["message"]
        # The same keep-alive connection serves the next, valid request.
        ok = client.post("/v1/completions", json={"model": "smol", "prompt": "Hi", "max_tokens": 2})
        assert ok.status_code == 200


def test_two_authorization_headers_are_refused_and_root_hides_the_path(server):
    keyed = server.keyed.base_url
    good = ("authorization", f"Bearer {API_KEY}")
    response = httpx.get(keyed + "/v1/models",
                         headers=httpx.Headers([good, ("authorization", "Bearer wrong")]))
    _check_body(response, 401)
    response = httpx.get(keyed + "/v1/models",
                         headers=httpx.Headers([("authorization", "Bearer wrong"), good]))
    _check_body(response, 401)
    models = httpx.get(keyed + "/v1/models", headers=httpx.Headers([good])).json()["data"]
    assert all(not m["root"].startswith("/") for m in models)


def test_empty_api_key_is_refused_before_loading():
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "ember.entrypoints.cli", "serve", "--api-key", ""],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "--api-key is empty" in done.stderr


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": "x", "max_tokens": "3"}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "stream": "yes"}, "stream"),
    ("/v1/completions", {"prompt": "x", "n": True}, "n"),
    ("/v1/completions", {"prompt": [[False]]}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 0},
     "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": 1},
     "logprobs"),
    ("/detokenize", {"tokens": [False]}, "tokens"),
])
def test_loose_types_are_400(server, path, body, param):
    error = _check_body(httpx.post(server.base_url + path, json={"model": MODEL_NAME, **body}),
                        400)
    assert param in (error.get("param") or "") + error["message"]


def test_health_declares_no_json_body(server):
    """/health answers 200 with an empty body, and its OpenAPI entry says so (no JSON)."""
    response = httpx.get(server.base_url + "/health")
    assert response.status_code == 200 and response.content == b""
    spec = httpx.get(server.base_url + "/openapi.json").json()
    assert "content" not in spec["paths"]["/health"]["get"]["responses"]["200"]
