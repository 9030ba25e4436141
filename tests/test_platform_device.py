"""The platform as the one owner of the device: the CPU versions of its device operations, the
defaults an out-of-tree platform inherits (an engine runs on a bare Platform subclass), the
worker's graph runner through a platform's graph hooks (with the backend's replay hook called),
the builder's choices (weight format, graph eligibility), and a check that no worker or executor
module names a device API."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from model_factory import make_tiny_model

import ember
from ember import LLM, SamplingParams
from ember import registry as reg
from ember.attention_backends.base import AttentionBackend
from ember.config import EngineArgs
from ember.platforms.base import Platform
from ember.platforms.cpu import CpuPlatform
from ember.platforms.cuda import CudaPlatform
from ember.platforms.rocm import RocmPlatform
from ember.registry import PlatformRegistry

EMBER_DIR = Path(ember.__file__).parent


def test_async_scheduling_default_follows_the_device():
    assert CpuPlatform.async_scheduling_default is False
    assert Platform.async_scheduling_default is False
    assert CudaPlatform.async_scheduling_default is True
    assert RocmPlatform.async_scheduling_default is True


def test_cpu_device_operations_are_host_defaults():
    cpu = CpuPlatform()
    assert cpu.device_is_host()
    # Its graphs are native-call replays (tests/test_cpu_graphs.py), refused where they cannot be.
    assert cpu.supports_cuda_graphs and cpu.graph_capture_checks_work
    assert cpu.graph_memory_pool() is None
    cpu.synchronize()
    cpu.record_event().synchronize()  # nothing queued: returns at once
    buf = cpu.empty_host_buffer(10, torch.int32)
    assert buf.shape == (10,) and buf.dtype == torch.int32 and buf.device.type == "cpu"
    assert not buf.is_pinned()
    x = torch.arange(4)
    assert cpu.copy_to_host(x) is x  # already on the host: no copy


def test_cpu_does_not_run_the_memory_profile():
    ran = []
    assert CpuPlatform().profile_peak_memory(lambda: ran.append(1)) == 0
    assert ran == []  # the CPU's KV budget does not depend on activations: not worth a forward


def test_graph_hooks_refuse_on_a_platform_without_graphs():
    class Bare(Platform):
        name = "bare"

    bare = Bare()
    assert not bare.supports_cuda_graphs and not bare.graph_capture_checks_work
    with pytest.raises(NotImplementedError, match="'bare' does not capture graphs"):
        bare.graph_memory_pool()
    with pytest.raises(NotImplementedError, match="'bare' does not capture graphs"):
        bare.capture_graph(lambda: None, None)


def test_a_non_host_device_is_staged():
    class Accelerator(Platform):
        name = "accel"
        device_type = "accel"

    assert not Accelerator().device_is_host()


class BarePlatform(Platform):
    """What an out-of-tree author might write against the interface: only what it must."""

    name = "bare"
    supported_dtypes = ["float32"]

    def kv_cache_memory_bytes(self, gpu_memory_utilization: float) -> int:
        return 64 << 20


def test_an_engine_runs_on_a_bare_platform_subclass(tmp_path, monkeypatch):
    """Every new Platform member has a default that works for a CPU-like device."""
    monkeypatch.delenv("EMBER_PLATFORM", raising=False)
    path = make_tiny_model("llama", tmp_path)
    prompts = [{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [9, 3]}]
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=2)
    expected = LLM(str(path), skip_tokenizer_init=True, max_model_len=64).generate(
        prompts, params, use_tqdm=False)
    with reg.isolated():
        PlatformRegistry.register_platform("bare", BarePlatform)
        llm = LLM(str(path), skip_tokenizer_init=True, max_model_len=64, device="bare",
                  async_scheduling=True)
        executor = llm.llm_engine.executor
        assert executor.platform.name == "bare" and executor.runner.graph_runner is None
        outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in expected]


# ---- the graph runner through a platform's hooks, on the CPU -----------------------------------
class FakeGraph:
    """Replays by rerunning the captured function into the captured output (same buffers)."""

    def __init__(self, run, output):
        self.run, self.output = run, output

    def replay(self):
        self.output.copy_(self.run())


class ReplayingCpu(CpuPlatform):
    name = "replaying_cpu"
    supports_cuda_graphs = True
    graph_capture_checks_work = False  # replays whatever it ran: needs a graph-safe backend

    def graph_memory_pool(self):
        return "pool"

    def capture_graph(self, run, pool):
        assert pool == "pool"
        output = run()
        return FakeGraph(run, output), output


class RecordingBackend(AttentionBackend):
    name = "recording"
    supports_cuda_graphs = True
    captured: list = []
    replays: list = []

    @classmethod
    def prepare_graph_capture(cls, max_batch_size, max_blocks_per_req, device):
        cls.captured.append((max_batch_size, max_blocks_per_req))

    @classmethod
    def prepare_for_replay(cls, metadata):
        cls.replays.append(metadata)


def _graph_runner(platform):
    from ember.worker.graph_runner import GraphRunner
    from ember.worker.input_stager import InputStager

    def model(input_ids, positions, ctx):
        # Reads the persistent buffers the way a model does: ids, positions and the metadata.
        return (input_ids * 1000 + positions + ctx.attn_metadata.seq_lens).float()

    runner = SimpleNamespace(
        platform=platform, device=platform.device(), attn_backend=RecordingBackend,
        model_config=SimpleNamespace(max_model_len=64), kv_caches=[], model=model,
        stager=InputStager(platform),
    )
    return GraphRunner(runner, max_batch_size=4, max_blocks_per_req=4)


def test_graph_runner_captures_and_replays_through_the_platform():
    RecordingBackend.captured.clear()
    RecordingBackend.replays.clear()
    graphs = _graph_runner(ReplayingCpu())
    graphs.capture()
    assert sorted(graphs.graphs) == [1, 2, 4] and RecordingBackend.captured == [(4, 4)]
    batch = SimpleNamespace(
        req_ids=["a", "b", "c"], num_decode_tokens=3,
        positions=np.array([4, 9, 2]), slot_mapping=np.array([4, 25, 34]),
        seq_lens=np.array([5, 10, 3], dtype=np.int32),
        block_table=np.array([[0, 0], [1, 0], [2, 0]], dtype=np.int32),
    )
    assert graphs.can_run(batch)
    with torch.inference_mode():  # as in ModelRunner.launch
        graphs.runner.stager.begin()
        out = graphs.run(batch, torch.tensor([7, 8, 9]))
        graphs.runner.stager.end()
    assert out.tolist() == [7000 + 4 + 5, 8000 + 9 + 10, 9000 + 2 + 3]
    (metadata,) = RecordingBackend.replays  # called once, before the replay, padded to 4 rows
    assert metadata.num_actual_tokens == 3 and metadata.seq_lens_cpu == [5, 10, 3, 0]
    assert metadata.max_seq_len == 10 and metadata.block_table.shape[0] == 4
    assert graphs.slot_mapping[3].item() == -1  # the padding row writes no KV


@pytest.mark.parametrize("host", [False, True], ids=["device", "host"])
def test_graph_capture_runs_with_the_garbage_collector_off(host):
    """A collection during capture could run finalizers that make device calls (freeing pinned
    memory, say), which invalidate a CUDA capture: the collector is off while graphs are
    captured, garbage made before is collected first on a device (on the host, whose graphs
    record native calls, that collection would only cost time), and the collector's state is
    restored."""
    import gc
    import weakref

    states: list[bool] = []

    class Watching(ReplayingCpu):
        def device_is_host(self):
            return host

        def capture_graph(self, run, pool):
            states.append(gc.isenabled())
            return super().capture_graph(run, pool)

    class Cycle:
        pass

    garbage = Cycle()
    garbage.me = garbage
    collected = weakref.ref(garbage)
    del garbage
    graphs = _graph_runner(Watching())
    assert gc.isenabled()
    try:
        graphs.capture()
        assert states == [False, False, False] and gc.isenabled()
        assert (collected() is None) == (not host)
    finally:
        gc.collect()
    gc.disable()
    try:  # a caller that had it off keeps it off
        graphs.capture()
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_backends_without_a_replay_hook_are_not_asked():
    from ember.attention_backends.sdpa import SdpaBackend
    from ember.worker.graph_runner import _overrides_replay_hook

    assert not _overrides_replay_hook(SdpaBackend)
    assert _overrides_replay_hook(RecordingBackend)


# ---- the builder's choices ----------------------------------------------------------------------
def test_graphs_need_platform_backend_and_no_enforce_eager():
    from ember.worker.builder import captures_graphs

    args = EngineArgs()
    assert captures_graphs(args, ReplayingCpu(), RecordingBackend)
    assert not captures_graphs(args, ReplayingCpu(), AttentionBackend)
    # A platform whose capture refuses what it cannot replay tries any backend.
    assert captures_graphs(args, CpuPlatform(), AttentionBackend)
    assert not captures_graphs(EngineArgs(enforce_eager=True), CpuPlatform(), AttentionBackend)
    assert not captures_graphs(EngineArgs(enforce_eager=True), ReplayingCpu(), RecordingBackend)


@pytest.mark.parametrize(("load_format", "is_gguf", "expected"), [
    ("auto", False, "safetensors"), ("auto", True, "gguf"), ("dummy", True, "dummy"),
    ("dummy", False, "dummy"), ("safetensors", False, "safetensors"), ("gguf", True, "gguf"),
])
def test_weight_format_from_the_model_config(load_format, is_gguf, expected):
    from ember.models.loader.formats import WEIGHT_LOADERS, weight_format

    cfg = SimpleNamespace(load_format=load_format, is_gguf=is_gguf, path="m")
    assert weight_format(cfg) == expected and expected in WEIGHT_LOADERS


def test_a_load_format_the_files_are_not_in_is_refused():
    from ember.models.loader.formats import weight_format

    with pytest.raises(ValueError, match="load_format='safetensors', but 'm.gguf' holds gguf"):
        weight_format(SimpleNamespace(load_format="safetensors", is_gguf=True, path="m.gguf"))


def test_an_explicit_load_format_reaches_its_loader(tmp_path):
    from test_gguf import write_gguf

    path = str(tmp_path / "m.gguf")
    write_gguf(path, "qwen2", tied=True)
    prompt = [{"prompt_token_ids": [5, 6, 7]}]
    params = SamplingParams(temperature=0.0, max_tokens=3)
    outs = [LLM(path, load_format=fmt, skip_tokenizer_init=True, max_model_len=64)
            .generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
            for fmt in ("auto", "gguf")]
    assert outs[0] == outs[1] and len(outs[0]) == 3
    with pytest.raises(ValueError, match="holds gguf weights"):
        LLM(path, load_format="safetensors", skip_tokenizer_init=True, max_model_len=64)


def test_dummy_weights_for_a_gguf_file_are_float_or_refused(tmp_path):
    """Random weights cannot be GGUF blocks: load_format="dummy" on a .gguf file is refused by
    name under the gguf method, and gives random float weights of its shapes with
    quantization="none"."""
    from test_gguf import write_gguf

    path = str(tmp_path / "m.gguf")
    write_gguf(path, "qwen2", tied=True)
    with pytest.raises(ValueError, match="load_format='dummy'.*quantization='none'"):
        LLM(path, load_format="dummy", skip_tokenizer_init=True, max_model_len=64)
    llm = LLM(path, load_format="dummy", quantization="none", skip_tokenizer_init=True,
              max_model_len=64)
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}],
                       SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
    llm.shutdown()


# ---- the device stays in ember/platforms -----------------------------------------------------
@pytest.mark.parametrize("package", ["worker", "executor"])
def test_no_worker_or_executor_module_names_a_device_api(package):
    device_api = re.compile(r"torch\.cuda|[\"']cuda[\"']")
    offenders = [
        f"{path.relative_to(EMBER_DIR.parent)}:{number}: {line.strip()}"
        for path in sorted((EMBER_DIR / package).rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if device_api.search(line)
    ]
    assert not offenders, "ask the Platform instead:\n" + "\n".join(offenders)
