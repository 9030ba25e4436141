"""CPU decode graphs: a forward's native calls captured once and replayed (ember.kernels.cpu.native,
CpuPlatform.capture_graph). A forward that does any other torch work is refused at capture and
runs eagerly; a replayed engine decodes exactly as an eager one."""

from __future__ import annotations

import gc

import pytest
import torch
from conftest import assert_all_blocks_free
from model_factory import make_tiny_model

from ember import LLM, SamplingParams
from ember.kernels.cpu import layer_ops, native
from ember.platforms.base import GraphCaptureRefused
from ember.platforms.cpu import CpuPlatform

pytestmark = pytest.mark.skipif(layer_ops.library() is None, reason="no C compiler")


def test_replay_reruns_the_native_calls_on_new_inputs():
    weight = torch.randn(32)
    x = torch.randn(3, 32)

    def forward():
        return layer_ops.silu_and_mul(layer_ops.rms_norm(x, weight, 1e-6))

    graph, out = native.capture(forward)
    assert [fn.__name__ for fn, _ in graph.calls] == ["ember_rms_norm", "ember_silu_and_mul"]
    x.copy_(torch.randn(3, 32))  # new inputs in the captured input tensor
    graph.replay()
    assert torch.equal(out, forward())  # the same calls, eagerly, on the new values


def test_capture_refuses_torch_work_and_names_it():
    x, weight = torch.randn(4, 8), torch.ones(8)
    with pytest.raises(native.CaptureRefused, match="add"):
        native.capture(lambda: layer_ops.rms_norm(x, weight, 1e-6) + 1)
    rows = torch.tensor([0, 2])
    with pytest.raises(GraphCaptureRefused, match="__getitem__"):  # advanced indexing copies
        CpuPlatform().capture_graph(lambda: x[rows], None)
    # Allocations, views and metadata are not work.
    graph, out = native.capture(lambda: torch.empty(2, 3).view(3, 2)[1:].t())
    assert graph.calls == [] and out.shape == (2, 2)
    assert native._recording is None  # a refused capture leaves no recorder behind


def test_capture_refuses_a_tensor_parallel_collective(monkeypatch):
    # torch.distributed's collectives pass no torch function mode: refused by name instead.
    from ember.distributed import communicator
    from ember.distributed import parallel_state as ps

    monkeypatch.setattr(ps, "get_tp_size", lambda: 2)
    x = torch.randn(2, 4)
    for collective in (communicator.tp_all_reduce, communicator.tp_all_gather):
        with pytest.raises(native.CaptureRefused, match="tensor-parallel collective"):
            native.capture(lambda collective=collective: collective(x))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    def make(arch: str) -> str:
        return str(make_tiny_model(arch, tmp_path_factory.mktemp(arch)))
    return make


def _decode(prompts, eager: bool, model: str | None = None, dtype: str = "auto"):
    llm = LLM(model, skip_tokenizer_init=True, max_model_len=256, enforce_eager=eager,
              max_num_seqs=8, dtype=dtype)
    graphs = llm.llm_engine.executor.runner.graph_runner
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    # Batches of 1, 3 (padded to 4) and 6 (padded to 8) requests, then n=2 sampled.
    tokens = []
    for batch in (prompts[:1], prompts[:3], prompts[:6]):
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        tokens.append([o.outputs[0].token_ids for o in outs])
    sampled = llm.generate({"prompt_token_ids": prompts[0]},
                           SamplingParams(temperature=0.8, seed=3, max_tokens=8, n=2),
                           use_tqdm=False)
    tokens.append([c.token_ids for c in sampled[0].outputs])
    assert_all_blocks_free(llm)
    captured = sorted(graphs.graphs) if graphs is not None else []
    llm.shutdown()
    del llm
    gc.collect()
    return tokens, captured


PROMPTS = [[1653 + 7 * i, 260, 2388 + i, 38798, 618][: 2 + i % 4] * (1 + i) for i in range(6)]


@pytest.mark.parametrize("arch", ["default", "llama", "qwen2", "qwen3"])
def test_engine_replays_decode_graphs_token_for_token(arch, tiny):
    """The default model (GGUF kept quantized: native matmuls) and float checkpoints (torch
    matmuls recorded as calls; Qwen2's biases and tied head, Qwen3's per-head q/k norms on
    strided views): replayed steps decode exactly as eager ones."""
    model = None if arch == "default" else tiny(arch)
    prompts = PROMPTS if arch == "default" else [[t % 300 for t in p] for p in PROMPTS]
    eager, none = _decode(prompts, eager=True, model=model)
    replayed, sizes = _decode(prompts, eager=False, model=model)
    assert none == [] and sizes == [1, 2, 4, 8]
    assert replayed == eager


def test_a_forward_that_is_not_native_runs_eagerly(tiny):
    # A bfloat16 model: the native layer ops take float32, so its norms are torch ops and the
    # capture is refused; steps run eagerly.
    model = tiny("llama")
    prompts = [[t % 300 for t in p] for p in PROMPTS]
    eager, _ = _decode(prompts, eager=True, model=model, dtype="bfloat16")
    refused, sizes = _decode(prompts, eager=False, model=model, dtype="bfloat16")
    assert sizes == [] and refused == eager
