"""Load (bounded, loopback only): 200 concurrent streaming chat requests to the default model
all complete with correct usage counts; afterwards every KV block is free and /metrics agrees
with the counts the clients saw.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest
from server_utils import MODEL_NAME, metric, parse_metrics, shared_server

NUM_REQUESTS = 200
MAX_TOKENS = 8


async def _one(client: openai.AsyncOpenAI, i: int) -> dict:
    messages = [{"role": "user", "content": f"Request {i}: name a colour and a number."}]
    stream = await client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=MAX_TOKENS, temperature=0.8, seed=i,
        stream=True, stream_options={"include_usage": True}, logprobs=True,
        extra_body={"ignore_eos": True},
    )
    text, tokens, usage, reasons = "", 0, None, []
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text += choice.delta.content or ""
            tokens += len(choice.logprobs.content) if choice.logprobs else 0
            if choice.finish_reason:
                reasons.append(choice.finish_reason)
    return {"messages": messages, "text": text, "tokens": tokens, "usage": usage,
            "reasons": reasons}


async def _run_all(base_url: str) -> list[dict]:
    limits = httpx.Limits(max_connections=NUM_REQUESTS + 10)
    async with httpx.AsyncClient(limits=limits, timeout=600) as http:
        client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0,
                                    http_client=http)
        return await asyncio.gather(*(_one(client, i) for i in range(NUM_REQUESTS)))


@pytest.mark.slow
def test_200_concurrent_streaming_chats():
    server = shared_server()
    url = server.base_url
    before = parse_metrics(httpx.get(url + "/metrics").text)
    start = time.perf_counter()
    results = asyncio.run(_run_all(url))
    elapsed = time.perf_counter() - start

    prompt_total = completion_total = 0
    with httpx.Client(base_url=url) as http:
        for r in results:
            usage = r["usage"]
            assert usage is not None and r["reasons"] == ["length"]
            assert usage.completion_tokens == MAX_TOKENS == r["tokens"]
            expected = http.post("/tokenize", json={"messages": r["messages"]}).json()["count"]
            assert usage.prompt_tokens == expected
            assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
            prompt_total += usage.prompt_tokens
            completion_total += usage.completion_tokens

    server.assert_idle()
    after = parse_metrics(httpx.get(url + "/metrics").text)

    def delta(name: str, **labels: str) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert delta("ember:prompt_tokens_total") == prompt_total
    assert delta("ember:generation_tokens_total") == completion_total
    assert delta("ember:request_success_total", finished_reason="length") == NUM_REQUESTS
    assert delta("ember:e2e_request_latency_seconds_count") == NUM_REQUESTS
    assert delta("ember:time_to_first_token_seconds_count") == NUM_REQUESTS
    assert delta("ember:inter_token_latency_seconds_count") == NUM_REQUESTS * (MAX_TOKENS - 1)
    for gauge in ("ember:num_requests_running", "ember:num_requests_waiting",
                  "ember:kv_cache_usage_perc"):
        assert metric(after, gauge) == 0.0, gauge
    print(f"\n{NUM_REQUESTS} streaming chats x {MAX_TOKENS} tokens in {elapsed:.1f} s")
