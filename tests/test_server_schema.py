"""Schemathesis against /openapi.json of the live server: generated requests (valid and
invalid) never get a 5xx. Bounded for CI: few examples per operation, and generation lengths
clamped so each example costs at most a few decode steps.

Cases are drawn with hypothesis from schemathesis' per-operation strategies (its pytest plugin
does not load under this pytest version). Its strings are valid Unicode; on top of them, hypothesis
puts unpaired surrogates (which JSON's \\uD800 escapes carry) into a share of the string values, at
any depth, since no valid-text generator produces them.
"""

from __future__ import annotations

import json
from urllib.parse import quote

import pytest
import requests

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from server_utils import shared_server  # noqa: E402

MAX_EXAMPLES = 20
OPERATIONS = [
    ("/v1/completions", "POST"),
    ("/v1/chat/completions", "POST"),
    ("/v1/embeddings", "POST"),
    ("/pooling", "POST"),
    ("/classify", "POST"),
    ("/score", "POST"),
    ("/v1/score", "POST"),
    ("/rerank", "POST"),
    ("/v1/rerank", "POST"),
    ("/v2/rerank", "POST"),
    ("/tokenize", "POST"),
    ("/detokenize", "POST"),
    ("/v1/models", "GET"),
    ("/v1/models/{model}", "GET"),
    ("/health", "GET"),
    ("/version", "GET"),
    ("/metrics", "GET"),
]


@pytest.fixture(scope="module")
def api_schema():
    server = shared_server()
    schema = schemathesis.openapi.from_url(server.base_url + "/openapi.json")
    listed = {(op.ok().path, op.ok().method.upper()) for op in schema.get_all_operations()}
    assert listed == set(OPERATIONS), listed  # a new endpoint must be added here
    return schema


def _clamp(body: dict) -> None:
    """Keep every generated request cheap: the point is input handling, not long generations."""
    for key in ("n", "best_of"):
        if isinstance(body.get(key), int) and body[key] > 2:
            body[key] = 2
    for key in ("max_tokens", "max_completion_tokens", "min_tokens"):
        if isinstance(body.get(key), int) and body[key] > 4:
            body[key] = 4
    if ("messages" in body or "prompt" in body) and body.get("max_tokens") is None:
        body["max_tokens"] = 4  # None means "up to the context length"
    if isinstance(body.get("prompt"), list) and len(body["prompt"]) > 3:
        body["prompt"] = body["prompt"][:3]


SURROGATES = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)


def _add_surrogates(value, data: st.DataObject):
    """`value` with unpaired surrogates inserted into some of its strings (keys included)."""
    if isinstance(value, str):
        if not data.draw(st.booleans()):
            return value
        at = data.draw(st.integers(0, len(value)))
        return value[:at] + data.draw(SURROGATES) + value[at:]
    if isinstance(value, list):
        return [_add_surrogates(v, data) for v in value]
    if isinstance(value, dict):
        return {_add_surrogates(k, data): _add_surrogates(v, data) for k, v in value.items()}
    return value


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["positive", "negative"])
@pytest.mark.parametrize("path,method", OPERATIONS)
def test_no_server_errors(api_schema, path, method, mode):
    if mode == "negative" and method != "POST":
        pytest.skip("no body or parameters to make invalid")
    operation = api_schema[path][method]
    strategy = operation.as_strategy(schemathesis.GenerationMode(mode))

    @given(case=strategy, data=st.data())
    @settings(max_examples=MAX_EXAMPLES, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    def check(case, data) -> None:
        if isinstance(case.body, dict):
            _clamp(case.body)
        # Schemathesis serializes the valid-Unicode case; surrogates go in after, as JSON
        # escapes in the body and as percent-encoded bytes (UTF-8 with surrogates) in the path.
        kwargs = case.as_transport_kwargs()
        if method == "POST" and isinstance(case.body, (dict, list, str)):
            kwargs.pop("json", None)
            kwargs["data"] = json.dumps(_add_surrogates(case.body, data)).encode()
            kwargs.setdefault("headers", {})["Content-Type"] = "application/json"
        if path == "/v1/models/{model}":
            model = _add_surrogates(case.path_parameters["model"], data)
            encoded = quote(model.encode("utf-8", "surrogatepass"), safe="")
            kwargs["url"] = kwargs["url"].rsplit("/", 1)[0] + "/" + encoded
        response = requests.request(**kwargs, timeout=120)
        assert response.status_code < 500, (case.body, response.status_code, response.text[:500])

    check()
