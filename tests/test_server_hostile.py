"""Hostile input, as a careless or malicious client sends it: unpaired surrogates and NUL bytes in
every text field, bytes that are not UTF-8, malformed, huge and deeply nested JSON, wrong types
and extreme values in every field, odd paths and headers. None may get a 5xx; every 4xx has an
OpenAI-style error body; afterwards the server answers a normal request exactly as before.
"""

from __future__ import annotations

import json
import socket

import httpx
import pytest
from server_utils import MODEL_NAME, shared_server

SURROGATE = "\ud800"
CHEAP = {"max_tokens": 2}
_cases: list[tuple[str, str, str, bytes, dict[str, str]]] = []


def _body(value) -> bytes:
    # json.dumps escapes a lone surrogate as \\ud800 (ensure_ascii), as a client library would.
    return json.dumps(value).encode()


def case(name: str, path: str, body, method: str = "POST", headers: dict | None = None) -> None:
    raw = body if isinstance(body, bytes) else _body(body)
    _cases.append((name, method, path, raw, headers or {"content-type": "application/json"}))


COMPLETION = {"model": MODEL_NAME, "prompt": "Hello", **CHEAP}
CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], **CHEAP}


def with_(base: dict, **changes) -> dict:
    return {**base, **changes}


# --- unpaired surrogates and NUL bytes in every text field ------------------------------------
for label, bad in [("surrogate", SURROGATE), ("nul", "a\x00b"), ("only-nul", "\x00"),
                   ("low-surrogate", "x\udfff")]:
    case(f"{label}-prompt", "/v1/completions", with_(COMPLETION, prompt=bad))
    case(f"{label}-prompt-list", "/v1/completions", with_(COMPLETION, prompt=["ok", bad]))
    case(f"{label}-prompt-stream", "/v1/completions", with_(COMPLETION, prompt=bad, stream=True))
    case(f"{label}-model", "/v1/completions", with_(COMPLETION, model=bad))
    case(f"{label}-stop", "/v1/completions", with_(COMPLETION, stop=[bad]))
    case(f"{label}-user", "/v1/completions", with_(COMPLETION, user=bad))
    case(f"{label}-suffix", "/v1/completions", with_(COMPLETION, suffix=bad))
    case(f"{label}-request-id", "/v1/completions", with_(COMPLETION, request_id=bad))
    case(f"{label}-chat-content", "/v1/chat/completions",
         with_(CHAT, messages=[{"role": "user", "content": bad}]))
    case(f"{label}-chat-part", "/v1/chat/completions",
         with_(CHAT, messages=[{"role": "user", "content": [{"type": "text", "text": bad}]}]))
    case(f"{label}-chat-name", "/v1/chat/completions",
         with_(CHAT, messages=[{"role": "user", "content": "x", "name": bad}]))
    case(f"{label}-chat-role", "/v1/chat/completions",
         with_(CHAT, messages=[{"role": bad, "content": "x"}]))
    case(f"{label}-chat-stop-stream", "/v1/chat/completions", with_(CHAT, stop=bad, stream=True))
    case(f"{label}-tokenize", "/tokenize", {"model": MODEL_NAME, "prompt": bad})
    case(f"{label}-tokenize-chat", "/tokenize",
         {"model": MODEL_NAME, "messages": [{"role": "user", "content": bad}]})
    case(f"{label}-detokenize-model", "/detokenize", {"model": bad, "tokens": [1, 2]})
    case(f"{label}-embeddings", "/v1/embeddings", {"model": MODEL_NAME, "input": bad})

# --- bytes that are not JSON, or not UTF-8 -------------------------------------------------
for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
    short = path.strip("/").replace("/", "-")
    case(f"not-utf8-{short}", path, b'{"prompt": "\xff\xfe\xfd", "max_tokens": 2}')
    case(f"truncated-{short}", path, b'{"prompt": "Hel')
    case(f"empty-{short}", path, b"")
    case(f"null-{short}", path, b"null")
    case(f"array-{short}", path, b"[1, 2, 3]")
    case(f"trailing-garbage-{short}", path, _body(COMPLETION) + b"}}}")
    case(f"nested-100k-{short}", path, b"[" * 100_000 + b"]" * 100_000)
case("nan-literal", "/v1/completions", b'{"prompt": "x", "temperature": NaN, "max_tokens": 2}')
case("infinity-literal", "/v1/completions", b'{"prompt": "x", "top_p": Infinity, "max_tokens": 2}')
case("huge-number", "/v1/completions", b'{"prompt": "x", "max_tokens": 1e999}')
case("huge-int", "/v1/completions", b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}")
case("duplicate-keys", "/v1/completions", b'{"prompt": "x", "prompt": 5, "max_tokens": 2}')
case("nested-field", "/v1/completions",
     b'{"prompt": "x", "max_tokens": 2, "logit_bias": ' + b'{"a": ' * 5000 + b"1" + b"}" * 5001)
case("deep-prompt", "/v1/completions", with_(COMPLETION, prompt=[[[[[[1]]]]]]))
case("wide-object", "/v1/completions", {**COMPLETION, **{f"k{i}": i for i in range(20_000)}})
case("text-plain-body", "/v1/completions", _body(COMPLETION), headers={"content-type": "text/plain"})
case("no-content-type", "/v1/completions", _body(COMPLETION), headers={})
case("over-body-limit", "/v1/completions", b'{"prompt": "' + b"a" * (17 << 20) + b'"}')

# --- wrong types and extreme values, field by field ----------------------------------------
COMPLETION_VALUES = {
    "model": [1, [], {}],
    "prompt": [None, {}, [], [[]], [1.5], [[1, "a"]], [-1], [2**63], [10**30], [True], 5,
               ["x"] * 5000],
    "max_tokens": ["3", 1.5, True, -1, 0, 2**64, 10**30],
    "temperature": ["hot", -1, 1e308, -1e308, [1]],
    "top_p": [0, -0.5, 2, 1e308],
    "top_k": [-2, 1.5, 2**63, "5"],
    "min_p": [-1, 2],
    "n": [0, -1, True, 10**9, 1.5],
    "best_of": [0, 10**9],
    "seed": [-1, 2**64, -(2**64), "x", 1.5],
    "stop": [5, [5], [""], ["x"] * 10_000, {}],
    "stop_token_ids": [[-1], [2**63], "x", [1.5]],
    "logprobs": [-1, 10**9, 100, True, "2"],
    "echo": ["yes", 2],
    "stream": ["yes", 1],
    "stream_options": [{"include_usage": "x"}, "x", {"include_usage": True}],
    "logit_bias": [{"a": 1}, {"999999999": 1}, {"1": "x"}, {"1": 1e308}, []],
    "presence_penalty": [1e9, -1e9],
    "frequency_penalty": [1e9, -1e9],
    "repetition_penalty": [0, -1, 1e308],
    "min_tokens": [-1, 10**9],
    "user": [5],
    "add_special_tokens": ["no"],
}
for field, values in COMPLETION_VALUES.items():
    for i, value in enumerate(values):
        case(f"completion-{field}-{i}", "/v1/completions", with_(COMPLETION, **{field: value}))

CHAT_VALUES = {
    "messages": [[], "x", [{}], [{"role": "wizard", "content": "x"}], [{"role": "user"}],
                 [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
                 [{"role": "user", "content": [{"type": "text"}]}],
                 [{"role": "user", "content": 5}], [{"role": "user", "content": None}],
                 [{"role": "user", "content": "x"}] * 5000],
    "max_completion_tokens": [-1, 0, "3", 10**30],
    "top_logprobs": [-1, 100, 10**9],
    "logprobs": ["yes"],
    "tools": ["x", [{"type": "function"}]],
    "tool_choice": [5, {"type": "function", "function": {"name": 5}}],
    "response_format": [{"type": "json_schema"}, "json", {"type": 5}],
    "n": [0, 10**9],
    "temperature": [-1e308],
}
for field, values in CHAT_VALUES.items():
    for i, value in enumerate(values):
        case(f"chat-{field}-{i}", "/v1/chat/completions", with_(CHAT, **{field: value}))

for i, tokens in enumerate([[-1], [2**63], [10**30], [1.5], [True], [[1]], "x", [49152]]):
    case(f"detokenize-{i}", "/detokenize", {"model": MODEL_NAME, "tokens": tokens})
for i, body in enumerate([{"prompt": "x", "add_special_tokens": "x"}, {},
                          {"prompt": "x", "messages": []}, {"messages": [{"role": "user"}]}]):
    case(f"tokenize-{i}", "/tokenize", body)
case("get-on-post-route", "/v1/completions", b"", method="GET")
case("delete-models", "/v1/models", b"", method="DELETE")
case("unknown-route", "/v1/nothing-here", _body(COMPLETION))
case("model-path-nul", "/v1/models/%00", b"", method="GET")
case("model-path-traversal", "/v1/models/..%2F..%2Fetc%2Fpasswd", b"", method="GET")
case("model-path-long", "/v1/models/" + "a" * 20_000, b"", method="GET")


@pytest.fixture(scope="module")
def server():
    return shared_server()


@pytest.fixture(scope="module")
def reference(server):
    """A greedy completion before the barrage; the same request must give it again after."""
    body = {"model": MODEL_NAME, "prompt": "The capital of France is", "max_tokens": 8,
            "temperature": 0}
    return body, httpx.post(server.base_url + "/v1/completions", json=body, timeout=120).json()


def test_there_are_enough_cases():
    assert len(_cases) >= 100
    assert len({c[0] for c in _cases}) == len(_cases)  # names are unique test ids


@pytest.mark.parametrize("name,method,path,raw,headers", _cases, ids=[c[0] for c in _cases])
def test_hostile_request(server, reference, name, method, path, raw, headers):
    response = httpx.request(method, server.base_url + path, content=raw, headers=headers,
                             timeout=120)
    assert response.status_code < 500, (name, response.status_code, response.text[:300])
    if response.status_code >= 400 and response.headers.get("content-type", "").startswith(
            "application/json"):
        error = response.json()["error"]
        assert error["message"] and "Traceback" not in error["message"]
    if response.status_code == 200 and response.headers.get("content-type", "").startswith(
            "text/event-stream"):
        assert response.text.rstrip().endswith("data: [DONE]")


def test_invalid_utf8_in_the_request_line_and_headers(server):
    for request in [b"GET /v1/models/\xed\xa0\x80 HTTP/1.1\r\nHost: x\r\n\r\n",
                    b"GET /health HTTP/1.1\r\nHost: x\r\nX-Bad: \xff\xfe\r\n\r\n",
                    b"GET /health HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \x00\r\n\r\n"]:
        with socket.create_connection(("127.0.0.1", server.open.port), timeout=30) as sock:
            sock.sendall(request)
            status_line = sock.recv(65536).split(b"\r\n", 1)[0]
        assert status_line.split()[1] < b"500", (request, status_line)


def test_server_answers_as_before_afterwards(server, reference):
    body, expected = reference
    again = httpx.post(server.base_url + "/v1/completions", json=body, timeout=120).json()
    assert again["choices"][0]["text"] == expected["choices"][0]["text"]
    server.assert_idle()
