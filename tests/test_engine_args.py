"""Every EngineArgs field has an effect (a test shows it) or is refused with an error naming it.

FIELD_TESTS maps each field to the tests that show its effect (here or elsewhere); a field added
to EngineArgs without an entry fails test_every_field_is_covered. The fields with no test of their
own elsewhere are checked here on a tiny random llama; so are the refusals of checkpoints ember
cannot load (pre-quantized weights, quantization="gguf" on an HF directory).
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path

import pytest
from model_factory import make_tiny_model

from ember import LLM, EngineArgs, SamplingParams

TESTS = Path(__file__).parent
HERE = "test_engine_args.py"

FIELD_TESTS: dict[str, list[str]] = {
    "model": ["test_load_errors.py::test_unknown_model_path",
              "test_hub_loading.py::test_unresolvable_names_are_clear",
              "test_engine_tiny_models.py::test_greedy_matches_hf"],
    "tokenizer": [f"{HERE}::test_tokenizer_path_is_used",
                  "test_hub_loading.py::test_hub_tokenizer_and_revision"],
    "revision": ["test_hub_loading.py::test_hub_name_revisions_offline",
                 "test_hub_loading.py::test_hub_only_arguments_refused_for_local_models"],
    "tokenizer_revision": ["test_hub_loading.py::test_hub_tokenizer_and_revision"],
    "download_dir": ["test_hub_loading.py::test_hub_name_revisions_offline"],
    "skip_tokenizer_init": [f"{HERE}::test_tokenizer_path_is_used"],
    "trust_remote_code": [f"{HERE}::test_trust_remote_code_reaches_transformers"],
    "dtype": [f"{HERE}::test_dtype_builds_the_model_in_it"],
    "seed": [f"{HERE}::test_seed_fixes_unseeded_sampling"],
    "max_model_len": [f"{HERE}::test_engine_sizes"],
    "max_logprobs": ["test_logits_processors_engine.py::test_max_logprobs_engine_argument"],
    "load_format": ["test_load_errors.py::test_dummy_weights_from_config_alone",
                    "test_platform_device.py::test_a_load_format_the_files_are_not_in_is_refused"],
    "quantization": ["test_quantization.py::test_int8_end_to_end_close_to_float",
                     f"{HERE}::test_prequantized_checkpoints_are_refused_by_method",
                     f"{HERE}::test_gguf_quantization_needs_a_gguf_file"],
    "device": ["test_platforms.py::test_explicit_device_and_env"],
    "attention_backend": ["test_platforms.py::test_override_argument_and_env"],
    "block_size": [f"{HERE}::test_engine_sizes"],
    "kv_cache_dtype": ["test_kv_cache_dtype.py::test_fp8_kv_cache_equals_attention_over_rounded_kv",  # noqa: E501
                       "test_kv_cache_dtype.py::test_kv_cache_dtype_refusals"],
    "enable_prefix_caching": ["test_engine_tiny_models.py::test_shared_prefix_hits_cache_and_keeps_outputs"],  # noqa: E501
    "gpu_memory_utilization": ["test_platforms.py::test_cuda_kv_cache_budget",
                               f"{HERE}::test_gpu_memory_utilization_on_the_cpu_says_it_does_nothing"],  # noqa: E501
    "kv_cache_memory_bytes": [f"{HERE}::test_engine_sizes"],
    "num_gpu_blocks_override": [f"{HERE}::test_engine_sizes"],
    "max_num_batched_tokens": [f"{HERE}::test_engine_sizes",
                               "test_engine_tiny_models.py::test_greedy_matches_hf"],
    "max_num_seqs": [f"{HERE}::test_max_num_seqs_caps_the_running_batch"],
    "scheduling_policy": ["test_priority_scheduling.py::test_llm_priority_order_and_fcfs_refusal"],
    "enforce_eager": ["test_platform_device.py::test_graphs_need_platform_backend_and_no_enforce_eager"],  # noqa: E501
    "compile_model": ["test_compile_model.py::test_compiled_model_equals_eager"],
    "async_scheduling": ["test_async_scheduling.py::test_async_equals_sync"],
    "tensor_parallel_size": ["test_distributed.py::test_mp_tp2_llama_then_worker_killed",
                             "test_distributed.py::test_parallel_args_refused",
                             f"{HERE}::test_refused_values_name_the_field"],
    "pipeline_parallel_size": ["test_distributed.py::test_mp_tp2_pp2_qwen3_more_ranks_than_kv_heads",  # noqa: E501
                               "test_distributed.py::test_parallel_args_refused"],
    "max_concurrent_batches": ["test_pipeline_overlap.py::test_pp2_batch_queue_equals_one_process",  # noqa: E501
                               "test_distributed.py::test_mp_tp2_pp2_qwen3_more_ranks_than_kv_heads",  # noqa: E501
                               "test_pipeline_overlap.py::test_max_concurrent_batches_args"],
    "distributed_executor_backend": ["test_distributed.py::test_ray_tp2_qwen3_more_ranks_than_kv_heads",  # noqa: E501
                                     "test_distributed.py::test_server_ray_pp2",
                                     "test_distributed.py::test_parallel_args_refused"],
    "disable_log_stats": ["test_stats_logging.py::test_llm_engine_logs_stats",
                          "test_stats_logging.py::test_default_logs_nothing"],
    "show_progress": [f"{HERE}::test_show_progress"],
    "hf_overrides": ["test_hf_overrides.py::test_dict_override_matches_transformers"],
    "generation_config": ["test_generation_config.py::test_auto_reads_the_models_values",
                          "test_generation_config.py::test_vllm_ignores_it"],
    "override_generation_config": ["test_generation_config.py::test_override_and_folder"],
    "enable_sleep_mode": ["test_engine_control.py::test_metrics_and_sleep_need_their_flags"],
    "runner": ["test_pooling.py::test_bert_classifier_matches_transformers",
               "test_pooling.py::test_decoder_last_token_embeddings_match_transformers"],
    "convert": ["test_pooling.py::test_task_and_convert_spellings"],
    "task": ["test_pooling.py::test_task_and_convert_spellings"],
    "structured_outputs_config": [
        "test_structured_outputs.py::test_json_schemas_validate",
        "test_structured_outputs.py::test_auto_backend_falls_back_to_guidance_and_caches_grammars",
        "test_structured_outputs_plugin.py::test_grammar_backend_from_an_entry_point"],
}


def test_every_field_is_covered():
    fields = EngineArgs.field_names()
    assert set(FIELD_TESTS) == fields, (
        f"fields without a test: {sorted(fields - set(FIELD_TESTS))}; "
        f"entries for no field: {sorted(set(FIELD_TESTS) - fields)}")
    for field, tests in FIELD_TESTS.items():
        for test in tests:
            file, name = test.split("::")
            source = (TESTS / file).read_text()
            assert re.search(rf"^(async )?def {name}\(", source, re.M), f"{field}: {test} is gone"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return str(make_tiny_model("llama", tmp_path_factory.mktemp("args")))


def _llm(path: str, **kw) -> LLM:
    kw.setdefault("skip_tokenizer_init", True)
    kw.setdefault("max_model_len", 128)
    return LLM(path, **kw)


# ---- refusals ----------------------------------------------------------------------------------

@pytest.mark.parametrize("config", [  # awq, gptq and fp8 load: test_awq_gptq.py, test_fp8.py
    {"quant_method": "bitsandbytes", "load_in_4bit": True},
    {"quant_method": "hqq", "nbits": 4},
    {"quant_method": "compressed-tensors", "format": "pack-quantized"},
], ids=lambda c: c["quant_method"])
def test_prequantized_checkpoints_are_refused_by_method(tiny, tmp_path, config):
    """Float weights must never be loaded as if a quantized checkpoint were unquantized."""
    target = tmp_path / "quantized"
    shutil.copytree(tiny, target)
    data = json.loads((target / "config.json").read_text())
    data["quantization_config"] = config
    (target / "config.json").write_text(json.dumps(data))
    method = config["quant_method"]
    for quantization in (None, "int8"):
        with pytest.raises(ValueError, match=rf"{method}-quantized weights"):
            _llm(str(target), quantization=quantization)


def test_gguf_quantization_needs_a_gguf_file(tiny):
    with pytest.raises(ValueError, match="quantization='gguf' needs a .gguf file"):
        _llm(tiny, quantization="gguf")


def test_refused_values_name_the_field(tiny):
    for kwargs, name in [({"tensor_parallel_size": 0}, "tensor_parallel_size"),
                         ({"block_size": 12}, "block_size"),
                         ({"load_format": "pt"}, "load_format"),
                         ({"generation_config": "/no/such/dir"}, "generation_config"),
                         ({"enable_chunked_prefill": True}, "enable_chunked_prefill")]:
        with pytest.raises(ValueError, match=name):
            _llm(tiny, **kwargs)


# ---- effects -----------------------------------------------------------------------------------

def test_engine_sizes(tiny):
    llm = _llm(tiny, block_size=8, num_gpu_blocks_override=40, max_num_batched_tokens=64,
               max_model_len=100)
    ready = llm.llm_engine.ready
    assert (ready.block_size, ready.num_blocks, ready.max_num_batched_tokens) == (8, 40, 64)
    assert llm.llm_engine.max_model_len == 100
    per_block = llm.collective_rpc("bytes_per_block")[0]
    llm.shutdown()
    llm = _llm(tiny, block_size=8, kv_cache_memory_bytes=per_block * 33)
    assert llm.llm_engine.ready.num_blocks == 33
    # unset, the platform's default (the CPU's: prefill chunks whose activations stay in cache)
    from ember.platforms.cpu import CpuPlatform

    assert llm.llm_engine.ready.max_num_batched_tokens == CpuPlatform.default_max_num_batched_tokens
    llm.shutdown()


def test_max_num_seqs_caps_the_running_batch(tiny):
    llm = _llm(tiny, max_num_seqs=2, num_gpu_blocks_override=64)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    for i in range(5):
        engine.add_request(str(i), {"prompt_token_ids": [3 + i, 4, 5]}, params)
    most = 0
    while engine.has_unfinished_requests():
        engine.step()
        most = max(most, engine.stats()["num_running"])
    assert most == 2
    llm.shutdown()


def test_seed_fixes_unseeded_sampling(tiny):
    params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5, 6, 7]}] * 3

    def sample(seed: int) -> list[list[int]]:
        llm = _llm(tiny, seed=seed, num_gpu_blocks_override=64)
        outs = llm.generate(prompts, params, use_tqdm=False)
        llm.shutdown()
        return [list(o.outputs[0].token_ids) for o in outs]

    first = sample(1)
    assert sample(1) == first
    assert sample(2) != first


def test_dtype_builds_the_model_in_it(tiny):
    import torch

    llm = _llm(tiny, dtype="bfloat16", num_gpu_blocks_override=16)
    dtypes = llm.apply_model(lambda m: {p.dtype for p in m.parameters()})[0]
    assert dtypes == {torch.bfloat16}
    llm.shutdown()


def test_tokenizer_path_is_used(tiny, tmp_path):
    """A model directory without a tokenizer works with tokenizer= pointing at one."""
    from ember.default_model import default_model_path
    from ember.tokenizer import load_tokenizer

    with pytest.raises(Exception):  # noqa: B017 - the tiny model has no tokenizer files
        LLM(tiny, max_model_len=128)
    load_tokenizer(default_model_path()).save_pretrained(tmp_path)
    llm = LLM(tiny, tokenizer=str(tmp_path), max_model_len=128, num_gpu_blocks_override=16)
    assert llm.get_tokenizer()("Hello").input_ids == load_tokenizer(str(tmp_path))("Hello").input_ids
    llm.shutdown()
    llm = LLM(tiny, tokenizer=str(tmp_path), skip_tokenizer_init=True, max_model_len=128,
              num_gpu_blocks_override=16)
    assert llm.get_tokenizer() is None
    llm.shutdown()


def test_trust_remote_code_reaches_transformers(tiny, monkeypatch):
    import transformers

    from ember.model_resolution import load_hf_config

    seen = []
    real = transformers.AutoConfig.from_pretrained

    def spy(path, **kw):
        seen.append(kw.get("trust_remote_code"))
        return real(path, **kw)

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", spy)
    load_hf_config(tiny, trust_remote_code=True)
    load_hf_config(tiny)
    assert seen == [True, False]


def test_show_progress(tiny, monkeypatch, capfd):
    monkeypatch.delenv("EMBER_DISABLE_PROGRESS", raising=False)
    _llm(tiny, num_gpu_blocks_override=16, show_progress=False).shutdown()
    assert "Loading safetensors" not in capfd.readouterr().err
    _llm(tiny, num_gpu_blocks_override=16, show_progress=True).shutdown()
    assert "Loading safetensors" in capfd.readouterr().err


def test_gpu_memory_utilization_on_the_cpu_says_it_does_nothing(tiny, caplog):
    with caplog.at_level(logging.WARNING, logger="ember"):
        _llm(tiny, gpu_memory_utilization=0.5).shutdown()
    assert "gpu_memory_utilization=0.5 has no effect on the CPU" in caplog.text
