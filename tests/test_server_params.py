"""vLLM's request fields on the server, each with its effect (through the official openai client,
vLLM's extras in `extra_body`) or a 400 naming it; unknown fields are refused, never ignored."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import jsonschema
import openai
import pytest
from server_utils import MODEL_NAME, ServerThread, shared_server

from ember.entrypoints.openai.api_server import build_app

PROMPT = "The capital of France is"
GREEDY = {"temperature": 0, "max_tokens": 6}


@pytest.fixture(scope="module")
def server():
    return shared_server()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def trusting(server):
    """A second app over the same engine that accepts request chat templates and has the
    development endpoints."""
    app = build_app(server.engine, [MODEL_NAME], shutdown_engine_on_exit=False,
                    trust_request_chat_template=True, dev_mode=True)
    thread = ServerThread(app).start()
    yield thread
    thread.stop()


def _ids(choice) -> list[int]:
    """Generated token ids, read from return_tokens_as_token_ids logprobs."""
    return [int(t.removeprefix("token_id:")) for t in choice.logprobs.tokens]


def _bad(client_call, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client_call()
    body = info.value.body
    assert param in (body.get("param") or "") + body.get("message", ""), body


def _greedy_ids(client, **extra) -> list[int]:
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, logprobs=0, **GREEDY,
                                    extra_body={"return_tokens_as_token_ids": True, **extra})
    return _ids(out.choices[0])


def test_unknown_fields_are_refused_by_name(client):
    _bad(lambda: client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2,
                                           extra_body={"frobnicate": 1}), "frobnicate")
    _bad(lambda: client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
        extra_body={"best_of": 2}), "best_of")
    _bad(lambda: client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
        extra_body={"functions": [{"name": "f"}]}), "functions")


def test_return_tokens_as_token_ids_and_logit_bias(client):
    plain = _greedy_ids(client)
    assert plain and all(isinstance(t, int) for t in plain)
    forced = plain[0] + 1
    biased = client.completions.create(model=MODEL_NAME, prompt=PROMPT, logprobs=0, **GREEDY,
                                       logit_bias={str(forced): 100},
                                       extra_body={"return_tokens_as_token_ids": True})
    assert _ids(biased.choices[0]) == [forced] * GREEDY["max_tokens"]
    _bad(lambda: client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2,
                                           logit_bias={"notatoken": 1}), "logit_bias")


def test_allowed_token_ids_and_bad_words(client):
    plain = _greedy_ids(client)
    allowed = sorted({plain[1], plain[2], 11, 12})
    ids = _greedy_ids(client, allowed_token_ids=allowed)
    assert set(ids) <= set(allowed)
    text = client.completions.create(model=MODEL_NAME, prompt=PROMPT, **GREEDY).choices[0].text
    first_word = text.split()[0]
    banned = client.completions.create(model=MODEL_NAME, prompt=PROMPT, **GREEDY,
                                       extra_body={"bad_words": [first_word]}).choices[0].text
    assert first_word not in banned.split()
    _bad(lambda: _greedy_ids(client, allowed_token_ids=[10**9]), "allowed_token_ids")


def test_truncate_prompt_tokens_and_prompt_logprobs(client):
    long_prompt = "one two three four five six seven eight nine ten " * 3
    out = client.completions.create(model=MODEL_NAME, prompt=long_prompt, max_tokens=1,
                                    extra_body={"truncate_prompt_tokens": 5})
    assert out.usage.prompt_tokens == 5
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=1,
                                    extra_body={"prompt_logprobs": 1})
    entries = out.choices[0].model_extra["prompt_logprobs"]
    assert len(entries) == out.usage.prompt_tokens and entries[0] is None
    assert all(len(e) >= 1 and all(v["logprob"] <= 0 for v in e.values()) for e in entries[1:])
    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=1,
        extra_body={"prompt_logprobs": 0})
    assert len(chat.model_extra["prompt_logprobs"]) == chat.usage.prompt_tokens


def test_cache_salt_separates_prefix_cache_hits(client):
    prompt = "A long shared prefix that fills more than one KV block. " * 6

    def cached(**extra) -> int:
        out = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=1,
                                        extra_body=extra)
        return out.usage.prompt_tokens_details.cached_tokens

    cached(cache_salt="alpha")
    assert cached(cache_salt="alpha") > 0
    assert cached(cache_salt="beta") == 0
    assert cached() == 0  # unsalted requests do not see salted blocks either


def test_priority_needs_priority_scheduling(client):
    _bad(lambda: _greedy_ids(client, priority=1), "priority")
    assert _greedy_ids(client, priority=0)  # the default is always fine


def test_beam_search_matches_the_engine(server, client):
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, n=2, max_tokens=5,
                                    temperature=0, extra_body={"use_beam_search": True})
    texts = [c.text for c in sorted(out.choices, key=lambda c: c.index)]

    async def engine_beams() -> list[str]:
        from ember.beam_search import BeamSearchParams

        ids = server.engine.tokenizer.encode(PROMPT)
        final = None
        async for item in server.engine.beam_search(
                {"prompt_token_ids": ids}, "beam-ref", BeamSearchParams(beam_width=2,
                                                                        max_tokens=5)):
            final = item
        return [c.text for c in final.outputs]

    assert texts == asyncio.run(engine_beams())
    assert len(set(texts)) == 2
    _bad(lambda: client.completions.create(model=MODEL_NAME, prompt=PROMPT, n=2, max_tokens=2,
                                           logprobs=1, extra_body={"use_beam_search": True}),
         "logprobs")


def test_vllm_xargs_names_logits_processors(client):
    _bad(lambda: _greedy_ids(client, vllm_xargs={"no_such_processor": 1}), "no_such_processor")


def test_continuous_usage_stats(client):
    stream = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=4, temperature=0, stream=True,
        stream_options={"include_usage": True},
        extra_body={"stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    chunks = list(stream)
    with_choices = [c for c in chunks if c.choices]
    assert with_choices and all(c.usage is not None for c in with_choices)
    assert [c.usage.completion_tokens for c in with_choices] == sorted(
        c.usage.completion_tokens for c in with_choices)


PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                          "age": {"type": "integer", "minimum": 0}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.mark.parametrize("extra,check", [
    ({"guided_choice": ["yes", "no"]}, lambda text: text in ("yes", "no")),
    ({"structured_outputs": {"choice": ["red", "blue"]}}, lambda text: text in ("red", "blue")),
    ({"guided_regex": "[0-9]{3}"}, lambda text: re.fullmatch("[0-9]{3}", text)),
    ({"guided_json": PERSON}, lambda text: jsonschema.validate(json.loads(text), PERSON) or True),
    ({"guided_grammar": 'root ::= "ab" | "cd"'}, lambda text: text in ("ab", "cd")),
])
def test_structured_outputs_on_completions(client, extra, check):
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=60,
                                    temperature=0, extra_body=extra)
    assert check(out.choices[0].text), out.choices[0].text
    assert out.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("response_format,check", [
    ({"type": "json_object"}, lambda text: isinstance(json.loads(text), dict)),
    ({"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}},
     lambda text: jsonschema.validate(json.loads(text), PERSON) or True),
])
@pytest.mark.parametrize("stream", [False, True])
def test_response_format_on_chat(client, response_format, check, stream):
    # A free "Describe a person." can send the small default model into a loop of repeated keys
    # (greedy, depending on what the prefix cache holds from earlier tests): ask for two keys.
    prompt = "Reply with a JSON object holding the name and the age of a person."
    kwargs = dict(model=MODEL_NAME, messages=[{"role": "user", "content": prompt}],
                  max_tokens=120, temperature=0, response_format=response_format)
    if stream:
        text = "".join(c.choices[0].delta.content or "" for c in
                       client.chat.completions.create(stream=True, **kwargs) if c.choices)
    else:
        text = client.chat.completions.create(**kwargs).choices[0].message.content
    assert check(text), text


def test_bad_constraints_are_400_before_a_stream_starts(server, client):
    bad_schema = {"type": "object", "properties": {"x": {"type": "no-such-type"}}}
    response = httpx.post(server.base_url + "/v1/completions", timeout=60, json={
        "model": MODEL_NAME, "prompt": "x", "max_tokens": 5, "stream": True,
        "guided_json": bad_schema})
    assert response.status_code == 400, response.text
    _bad(lambda: _greedy_ids(client, guided_regex="[0-9]", guided_choice=["a"]), "guided_choice")
    _bad(lambda: _greedy_ids(client, structured_outputs={"choice": ["a"], "nonsense": 1}),
         "structured_outputs")
    _bad(lambda: _greedy_ids(client, guided_whitespace_pattern=" "), "guided_whitespace_pattern")
    _bad(lambda: _greedy_ids(client, guided_regex="([a-z"), "structured_outputs")
    _bad(lambda: _greedy_ids(client, guided_grammar="root ::= (((("), "structured_outputs")
    not_a_schema = [{"type": "function",
                     "function": {"name": "f", "parameters": {"type": "no-such-type"}}}]
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL_NAME, max_tokens=2, tools=not_a_schema,
                                       tool_choice="required",
                                       messages=[{"role": "user", "content": "Hi"}])


def test_openai_parse_with_a_pydantic_model(client):
    from pydantic import BaseModel, Field

    class City(BaseModel):
        name: str = Field(max_length=20)
        population: int = Field(ge=0, le=10**8)

    out = client.chat.completions.parse(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Describe Paris as JSON."}],
        response_format=City, max_tokens=80, temperature=0)
    assert isinstance(out.choices[0].message.parsed, City)
    _bad(lambda: _greedy_ids(client, guided_choice=["a"], guided_decoding_backend="other"),
         "guided_decoding_backend")


def test_tool_fields_without_tools(client):
    messages = [{"role": "user", "content": "Hi"}]
    ok = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=2,
                                        tool_choice="none")
    assert ok.choices[0].message.content is not None
    _bad(lambda: client.chat.completions.create(model=MODEL_NAME, messages=messages,
                                                max_tokens=2, tool_choice="auto"),
         "tool_choice")
    _bad(lambda: client.chat.completions.create(model=MODEL_NAME, messages=messages,
                                                max_tokens=2, parallel_tool_calls=True),
         "parallel_tool_calls")
    _bad(lambda: client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=2,
        response_format={"type": "yaml"}), "response_format")


def test_chat_template_needs_trust_and_kwargs_reach_it(client, trusting):
    template = "{{ greeting }}{% for m in messages %} {{ m['content'] }}{% endfor %}"
    messages = [{"role": "user", "content": "there"}]
    _bad(lambda: client.chat.completions.create(model=MODEL_NAME, messages=messages,
                                                max_tokens=1,
                                                extra_body={"chat_template": template}),
         "chat_template")
    trusted = openai.OpenAI(base_url=trusting.base_url + "/v1", api_key="none", max_retries=0)
    tokenizer = shared_server().engine.tokenizer

    def prompt_tokens(**extra) -> int:
        return trusted.chat.completions.create(model=MODEL_NAME, messages=messages,
                                               max_tokens=1, extra_body=extra).usage.prompt_tokens

    greeted = prompt_tokens(chat_template=template,
                            chat_template_kwargs={"greeting": "Hello hello hello"})
    assert greeted == len(tokenizer.encode("Hello hello hello there",
                                           add_special_tokens=False))
    effort_template = "{{ reasoning_effort }}{% for m in messages %} {{ m['content'] }}{% endfor %}"
    assert prompt_tokens(chat_template=effort_template, reasoning_effort="high") == len(
        tokenizer.encode("high there", add_special_tokens=False))


def test_dev_endpoints(server, trusting):
    assert httpx.post(trusting.base_url + "/reset_prefix_cache").status_code == 200
    assert httpx.get(trusting.base_url + "/is_sleeping").json() == {"is_sleeping": False}
    refused = httpx.post(trusting.base_url + "/sleep", params={"level": 1})
    assert refused.status_code == 400 and "sleep" in refused.json()["error"]["message"]
    # Not on a server without the development mode.
    assert httpx.post(server.base_url + "/reset_prefix_cache").status_code == 404


def test_model_generation_defaults_fill_unset_fields(server):
    from ember.entrypoints.openai.protocol import CompletionRequest
    from ember.entrypoints.openai.serving_params import sampling_params

    ctx = server.open.app.state.ctx
    saved = ctx.default_sampling
    ctx.default_sampling = {"temperature": 0.25, "top_k": 7, "max_tokens": 3}
    try:
        req = CompletionRequest(prompt="x", max_tokens=None)
        params = sampling_params(req, ctx, ctx.check_length(2, None, "prompt"), None)
        assert (params.temperature, params.top_k, params.max_tokens) == (0.25, 7, 3)
        explicit = sampling_params(CompletionRequest(prompt="x", temperature=0.9), ctx, 4, None)
        assert explicit.temperature == 0.9
    finally:
        ctx.default_sampling = saved


def test_request_fields_reach_the_openapi_schema(server):
    schema = httpx.get(server.base_url + "/openapi.json").json()["components"]["schemas"]
    for name in ("guided_json", "priority", "cache_salt", "use_beam_search", "vllm_xargs",
                 "bad_words", "allowed_token_ids", "truncate_prompt_tokens", "prompt_logprobs"):
        assert name in schema["CompletionRequest"]["properties"], name
    assert schema["CompletionRequest"].get("additionalProperties") is False
    assert json.dumps(schema)  # serializable as served
