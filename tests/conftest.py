"""Shared fixtures: quiet progress bars, the GPU marker, and the KV-leak check."""

import os

import pytest

os.environ.setdefault("EMBER_DISABLE_PROGRESS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def check_idle_report(report: dict) -> None:
    """An EngineCore.idle_report(): nothing left to run, every KV block back in the free queue."""
    assert not report["has_work"], report
    assert report["num_free_blocks"] == report["num_total_blocks"], report
    assert report["requests_holding_blocks"] == 0, report


def run_sm90_script(script: str, timeout: float = 600):
    """Run ``script`` (which compiles kernels for sm90 through tests/sm90_launch.py) in a fresh
    interpreter: no TRITON_INTERPRET (this process may have it set), this directory importable.
    Returns the subprocess.CompletedProcess (text output captured)."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    here = os.path.dirname(os.path.abspath(__file__))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [here, env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=timeout)


def assert_all_blocks_free(llm_or_engine) -> None:
    """Every KV block is free and no request is left, in the front end or the engine core
    (an LLM or LLMEngine, with its core in this process or in its own)."""
    engine = getattr(llm_or_engine, "llm_engine", llm_or_engine)
    assert not engine.has_unfinished_requests()
    assert not engine.output_processor.parents
    check_idle_report(engine.call_core("idle_report"))


async def assert_all_blocks_free_async(async_llm) -> None:
    """assert_all_blocks_free for an AsyncLLM (its core is always in another process). The
    core may still be finishing a step that was in flight when the last request ended."""
    import asyncio

    assert not async_llm.output_processor.parents
    for _ in range(100):
        report = await async_llm.call_core("idle_report")
        if not report["has_work"]:
            break
        await asyncio.sleep(0.02)
    check_idle_report(report)


@pytest.fixture(scope="module")
def server():
    """The process-wide default-model OpenAI server (started once, shared by server tests)."""
    from server_utils import shared_server

    return shared_server()


@pytest.fixture(scope="module")
def client(server):
    """The official openai client pointed at that server."""
    import openai

    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
