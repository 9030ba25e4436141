"""Test helpers for request-level parameters: a tiny random model that has a real tokenizer (the
default model's, so text, stop strings and chat templates work), and drivers that run requests
through LLMEngine.step() and AsyncLLM.generate() keeping every output.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from model_factory import make_tiny_model

from ember import EngineArgs
from ember.outputs import RequestOutput

# A prompt of a few dozen tokens, so prefix-cache blocks (16 tokens) fill up.
PROMPT = ("The quick brown fox jumps over the lazy dog while the cat sleeps on the warm mat and "
          "the birds sing in the old oak tree behind the red barn near the river")


def make_text_model(tmp_dir: str | Path) -> str:
    """A tiny random qwen3 whose vocabulary matches the default model's tokenizer."""
    return str(make_tiny_model("qwen3", tmp_dir, vocab_size=49152))


def text_args(path: str, **kw) -> EngineArgs:
    from ember.default_model import default_model_path

    base = dict(model=path, tokenizer=default_model_path(), max_model_len=256)
    base.update(kw)
    return EngineArgs(**base)


def run_engine(engine, requests: list[tuple[str, object, object]], **add_kw) -> list[RequestOutput]:
    """Add (request_id, prompt, params) requests to an LLMEngine and step it dry; every output
    it returned, in order."""
    for request_id, prompt, params in requests:
        engine.add_request(request_id, prompt, params, **add_kw)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    return outputs


def collect_async(engine, prompt, params, request_id: str, **kw) -> list[RequestOutput]:
    """Every output AsyncLLM.generate yields for one request."""

    async def run() -> list[RequestOutput]:
        return [out async for out in engine.generate(prompt, params, request_id, **kw)]

    return asyncio.run(run())


def join_deltas(outputs: list[RequestOutput]) -> dict[int, tuple[str, list[int], str | None]]:
    """Per completion index: (concatenated text, concatenated token ids, last finish reason)."""
    joined: dict[int, tuple[str, list[int], str | None]] = {}
    for out in outputs:
        for c in out.outputs:
            text, ids, _ = joined.get(c.index, ("", [], None))
            joined[c.index] = (text + c.text, ids + list(c.token_ids), c.finish_reason)
    return joined


def final_by_index(output: RequestOutput) -> dict[int, tuple[str, list[int], str | None]]:
    return {c.index: (c.text, list(c.token_ids), c.finish_reason) for c in output.outputs}
