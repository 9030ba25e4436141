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


def assert_all_blocks_free(llm_or_engine) -> None:
    """Every KV block is back in the free queue and no request is left in the engine."""
    engine = getattr(llm_or_engine, "llm_engine", llm_or_engine)
    assert not engine.has_unfinished_requests()
    assert engine.num_free_blocks() == engine.num_total_blocks()
    assert not engine.kv_cache_manager.req_to_blocks
    assert not engine.output_processor.parents


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
