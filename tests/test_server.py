"""The OpenAI-compatible server on the default model, through the official `openai` client:
completions and chat, streamed and not, n > 1, stop, logprobs, seeds, echo, usage counts,
tokenize/detokenize, metrics, and client disconnects (KV blocks return to the free pool).
Error statuses are in test_server_errors.py.
"""

from __future__ import annotations

import time

import httpx
import pytest
from server_utils import MODEL_NAME, metric, parse_metrics

PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Write one sentence about the sea."}]



def _token_count(server, **body) -> int:
    return httpx.post(server.base_url + "/tokenize", json=body).json()["count"]


def _stream_text(stream, n: int = 1) -> tuple[list[str], list[str | None], object]:
    texts, reasons, usage = [""] * n, [None] * n, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            piece = choice.delta.content if hasattr(choice, "delta") else choice.text
            texts[choice.index] += piece or ""
            if choice.finish_reason is not None:
                assert reasons[choice.index] is None, "finish_reason sent twice"
                reasons[choice.index] = choice.finish_reason
    return texts, reasons, usage


def test_models_version_health_openapi(server, client):
    ids = [m.id for m in client.models.list().data]
    assert ids == [MODEL_NAME, "SmolLM2-135M-Instruct"]
    assert client.models.retrieve(MODEL_NAME).id == MODEL_NAME
    assert httpx.get(server.base_url + "/health").status_code == 200
    assert httpx.get(server.base_url + "/version").json()["version"]
    schema = httpx.get(server.base_url + "/openapi.json").json()
    assert "/v1/chat/completions" in schema["paths"]


def test_completion_usage_and_greedy_determinism(server, client):
    a = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=10, temperature=0)
    b = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=10, temperature=0)
    assert a.choices[0].text == b.choices[0].text and a.choices[0].text
    assert a.choices[0].finish_reason in ("length", "stop")
    assert a.usage.prompt_tokens == _token_count(server, prompt=PROMPT)
    assert a.usage.total_tokens == a.usage.prompt_tokens + a.usage.completion_tokens
    assert a.object == "text_completion" and a.model == MODEL_NAME


@pytest.mark.parametrize("n", [1, 3])
def test_completion_stream_equals_full_with_seed(client, n):
    kw = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=16, temperature=0.9, seed=1234, n=n)
    full = client.completions.create(**kw)
    again = client.completions.create(**kw)
    texts, reasons, usage = _stream_text(
        client.completions.create(stream=True, stream_options={"include_usage": True}, **kw), n)
    assert [c.text for c in full.choices] == [c.text for c in again.choices]  # seeded
    assert texts == [c.text for c in full.choices]
    assert reasons == [c.finish_reason for c in full.choices]
    assert usage.model_dump(exclude={"prompt_tokens_details"}) == full.usage.model_dump(
        exclude={"prompt_tokens_details"})  # the second request may hit the prefix cache
    assert [c.index for c in full.choices] == list(range(n))
    if n > 1:
        assert len({c.text for c in full.choices}) > 1  # distinct seeds per sample


def test_chat_stream_equals_full(server, client):
    kw = dict(model=MODEL_NAME, messages=CHAT, max_tokens=24, temperature=0.8, seed=7, n=2)
    full = client.chat.completions.create(**kw)
    stream = client.chat.completions.create(stream=True, stream_options={"include_usage": True},
                                            **kw)
    texts, reasons, usage = _stream_text(stream, 2)
    assert texts == [c.message.content for c in full.choices]
    assert reasons == [c.finish_reason for c in full.choices]
    assert full.choices[0].message.role == "assistant"
    assert usage.model_dump(exclude={"prompt_tokens_details"}) == full.usage.model_dump(
        exclude={"prompt_tokens_details"})  # the second request may hit the prefix cache
    assert full.usage.prompt_tokens == _token_count(server, messages=CHAT)
    assert 2 <= full.usage.completion_tokens <= 2 * 24
    other = client.chat.completions.create(**{**kw, "seed": 8})
    assert [c.message.content for c in other.choices] != texts


def test_max_tokens_and_max_completion_tokens(client):
    base = dict(model=MODEL_NAME, messages=CHAT, temperature=0, extra_body={"ignore_eos": True})
    assert client.chat.completions.create(max_tokens=5, **base).usage.completion_tokens == 5
    out = client.chat.completions.create(max_completion_tokens=3, max_tokens=9, **base)
    assert out.usage.completion_tokens == 3 and out.choices[0].finish_reason == "length"


def test_stop_strings(client):
    base = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=24, temperature=0)
    text = client.completions.create(**base).choices[0].text
    words = [w for w in text.split() if len(w) > 2]
    assert words, text
    stop = words[len(words) // 2]
    cut = text[: text.index(stop)]
    out = client.completions.create(stop=[stop], **base).choices[0]
    assert out.text == cut and out.finish_reason == "stop"
    texts, reasons, _ = _stream_text(client.completions.create(stop=stop, stream=True, **base))
    assert texts == [cut] and reasons == ["stop"]


def test_completion_logprobs_and_echo(server, client):
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=6, temperature=0,
                                    logprobs=3)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == out.usage.completion_tokens
    assert "".join(lp.tokens) == out.choices[0].text
    assert all(v <= 0 for v in lp.token_logprobs)
    assert all(1 <= len(top) <= 4 for top in lp.top_logprobs)
    assert lp.text_offset == sorted(lp.text_offset)
    # Greedy: the chosen token is the most likely one.
    assert all(top[tok] == max(top.values()) for tok, top in zip(lp.tokens, lp.top_logprobs))

    echo = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=6,
                                     temperature=0, logprobs=1, echo=True)
    choice = echo.choices[0]
    assert choice.text == PROMPT + out.choices[0].text
    n_prompt = echo.usage.prompt_tokens
    assert len(choice.logprobs.tokens) == n_prompt + 6
    assert choice.logprobs.token_logprobs[0] is None and choice.logprobs.token_logprobs[1] < 0
    texts, _, _ = _stream_text(client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=6, temperature=0, echo=True, stream=True))
    assert texts == [choice.text]


def test_token_prompts_and_batches(client):
    ids = client.completions.create(model=MODEL_NAME, prompt=[[1, 2, 3], [4, 5]], max_tokens=3,
                                    temperature=0, n=2)
    assert [c.index for c in ids.choices] == [0, 1, 2, 3]
    assert ids.usage.prompt_tokens == 5 and ids.usage.completion_tokens <= 12
    one = client.completions.create(model=MODEL_NAME, prompt=[1, 2, 3], max_tokens=3,
                                    temperature=0)
    assert one.choices[0].text == ids.choices[0].text


def test_chat_logprobs(client):
    out = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=5,
                                         temperature=0, logprobs=True, top_logprobs=3)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token  # greedy picks the top token
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
    stream = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=5,
                                            temperature=0, logprobs=True, stream=True)
    streamed = [e.token for ch in stream for c in ch.choices if c.logprobs
                for e in c.logprobs.content]
    assert streamed == [e.token for e in content]


def test_tokenize_detokenize(server):
    url = server.base_url
    tokens = httpx.post(url + "/tokenize", json={"prompt": PROMPT}).json()
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == 1024
    text = httpx.post(url + "/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"]
    assert text.endswith(PROMPT)


def _wait_free(server) -> None:
    server.assert_idle()


def test_stream_disconnect_frees_blocks(server):
    before = parse_metrics(httpx.get(server.base_url + "/metrics").text)
    body = {"model": MODEL_NAME, "messages": CHAT, "max_tokens": 400, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", server.base_url + "/v1/chat/completions", json=body,
                      timeout=60) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        for _ in range(6):
            next(lines)
    # the connection is closed here, mid-generation
    _wait_free(server)
    after = parse_metrics(httpx.get(server.base_url + "/metrics").text)
    assert metric(after, "ember:request_success_total", finished_reason="abort") == metric(
        before, "ember:request_success_total", finished_reason="abort") + 1
    assert metric(after, "ember:kv_cache_usage_perc") == 0.0


def test_non_stream_disconnect_frees_blocks(server):
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 600, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.base_url + "/v1/completions", json=body, timeout=1.0)
    _wait_free(server)


def test_metrics_names(server, client):
    client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2)
    time.sleep(0.1)
    text = httpx.get(server.base_url + "/metrics").text
    for name in ("ember:prompt_tokens_total", "ember:generation_tokens_total",
                 "ember:num_requests_running", "ember:num_requests_waiting",
                 "ember:kv_cache_usage_perc", "ember:time_to_first_token_seconds_bucket",
                 "ember:inter_token_latency_seconds_bucket",
                 "ember:e2e_request_latency_seconds_bucket", "ember:request_success_total"):
        assert name in text, name
    assert metric(parse_metrics(text), "ember:request_success_total", finished_reason="length")


def test_client_request_ids_never_collide(server):
    """A client's request_id names its response only: the same id from two requests at once, or
    a chat id that looks like a completion's engine id, does not block anyone."""
    import concurrent.futures

    def post(path: str, body: dict) -> httpx.Response:
        return httpx.post(server.base_url + path, json=body, timeout=120)

    completion = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 8, "ignore_eos": True,
                  "request_id": "zz"}
    chat = {"model": MODEL_NAME, "messages": CHAT, "max_tokens": 8, "ignore_eos": True,
            "request_id": "zz-0"}
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(post, "/v1/completions", completion) for _ in range(2)]
        futures.append(pool.submit(post, "/v1/chat/completions", chat))
        responses = [f.result() for f in futures]
    assert [r.status_code for r in responses] == [200, 200, 200], [r.text for r in responses]
    assert [r.json()["id"] for r in responses] == ["zz", "zz", "zz-0"]
    _wait_free(server)
