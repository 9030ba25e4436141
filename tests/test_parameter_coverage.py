"""Every parameter works or is refused: each field of SamplingParams, of the prompt types and of
the server's request models names the tests that show its effect or its refusal, and a field
added without one fails here. (EngineArgs has the same rule in test_engine_args.py.)

The server half also checks, field by field, that a request's value reaches the engine as the
SamplingParams, prompt or priority the offline tests exercise.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from pathlib import Path

import httpx
import pytest
from server_utils import MODEL_NAME, ServerThread, shared_server

from ember.entrypoints.openai import protocol, protocol_pooling
from ember.entrypoints.openai.api_server import build_app
from ember.inputs import TextPrompt, TokensPrompt
from ember.sampling_params import SamplingParams

TESTS = Path(__file__).parent
HERE = "test_parameter_coverage.py"
REACHES = f"{HERE}::test_server_field_reaches_the_engine"

SAMPLING_FIELD_TESTS = {
    "n": ["test_default_model.py::test_n_samples_and_prompt_logprobs"],
    "temperature": ["test_sampler.py::test_temperature_zero_is_argmax",
                    "test_sampler.py::test_empirical_distribution_matches_target"],
    "top_p": ["test_sampler.py::test_top_p_keeps_at_least_one_token"],
    "top_k": ["test_default_model.py::test_top_k_one_equals_greedy",
              "test_sampler.py::test_top_k_fast_path_equals_sort_path"],
    "min_p": ["test_logits_processors.py::test_min_p_matches_hf_min_p_warper_after_temperature"],
    "seed": ["test_default_model.py::test_seeded_sampling_reproduces_alone_and_batched"],
    "presence_penalty": ["test_sampler.py::test_presence_penalty_output_only"],
    "frequency_penalty": ["test_sampler.py::test_frequency_penalty_counts_output_only"],
    "repetition_penalty": ["test_sampler.py::test_repetition_penalty_prompt_and_output"],
    "max_tokens": ["test_server.py::test_max_tokens_and_max_completion_tokens"],
    "min_tokens": ["test_logits_processors.py::test_min_tokens_matches_hf_min_new_tokens",
                   "test_output_kinds.py::test_min_tokens_holds_back_stop_strings"],
    "stop": ["test_default_model.py::test_stop_strings_cut_text_exactly"],
    "stop_token_ids": ["test_default_model.py::test_stop_token_ids_and_min_tokens"],
    "include_stop_str_in_output": ["test_detokenizer.py::test_stop_string_cut_exactly"],
    "ignore_eos": ["test_beam_search.py::test_same_beams_and_scores_as_hf_without_eos",
                   f"{HERE}::test_detokenize_false_and_ignore_eos"],
    "logprobs": ["test_sampler.py::test_logprobs_are_raw_and_ranked",
                 "test_logits_processors.py::test_logprob_caps"],
    "prompt_logprobs": ["test_default_model.py::test_n_samples_and_prompt_logprobs"],
    "skip_special_tokens": ["test_detokenizer.py::test_special_tokens"],
    "spaces_between_special_tokens": ["test_detokenizer.py::test_special_tokens"],
    "detokenize": [f"{HERE}::test_detokenize_false_and_ignore_eos"],
    "output_kind": ["test_output_kinds.py::test_output_kinds_agree"],
    "truncate_prompt_tokens": ["test_prompt_fields.py::test_truncate_prompt_tokens"],
    "logit_bias": ["test_logits_processors.py::test_logit_bias_matches_hf_sequence_bias"],
    "allowed_token_ids": [
        "test_logits_processors.py::test_allowed_token_ids_matches_hf_suppress_tokens"],
    "bad_words": ["test_logits_processors_engine.py::test_bad_words_match_hf_no_bad_words"],
    "extra_args": [
        "test_logits_processors_engine.py::test_registered_processor_selected_by_name_matches_hf"],
    "logits_processors": ["test_logits_processors.py::test_sampling_params_errors_name_the_field"],
    "structured_outputs": ["test_structured_outputs.py::test_json_schemas_validate"],
}
# Filled by the engine, not by users.
ENGINE_FILLED = {"all_stop_token_ids", "_bad_words_token_ids"}

PROMPT_KEY_TESTS = {
    "prompt": ["test_default_model.py::test_prompt_forms_and_per_prompt_params"],
    "prompt_token_ids": ["test_default_model.py::test_prompt_forms_and_per_prompt_params"],
    "cache_salt": ["test_prompt_fields.py::test_cache_salt_separates_prefix_cache"],
    "multi_modal_data": ["test_prompt_fields.py::test_refused_prompt_fields"],
    "mm_processor_kwargs": ["test_prompt_fields.py::test_refused_prompt_fields"],
    "token_type_ids": ["test_prompt_fields.py::test_refused_prompt_fields"],
}

_SAMPLING_ON_SERVER = {
    "model": ["test_server_errors.py::test_openai_client_exceptions"],
    "n": [REACHES], "temperature": [REACHES], "top_p": [REACHES], "presence_penalty": [REACHES],
    "frequency_penalty": [REACHES], "seed": [REACHES], "stop": [REACHES],
    "stream": ["test_server.py::test_chat_stream_equals_full"],
    "stream_options": ["test_server_params.py::test_continuous_usage_stats"],
    "user": [f"{HERE}::test_user_is_accepted_as_in_vllm"],
    "logit_bias": ["test_server_params.py::test_return_tokens_as_token_ids_and_logit_bias"],
    "top_k": [REACHES], "min_p": [REACHES], "repetition_penalty": [REACHES],
    "min_tokens": [REACHES], "ignore_eos": [REACHES], "stop_token_ids": [REACHES],
    "include_stop_str_in_output": [REACHES], "skip_special_tokens": [REACHES],
    "spaces_between_special_tokens": [REACHES],
    "request_id": ["test_server.py::test_client_request_ids_never_collide"],
    "allowed_token_ids": ["test_server_params.py::test_allowed_token_ids_and_bad_words"],
    "bad_words": ["test_server_params.py::test_allowed_token_ids_and_bad_words"],
    "truncate_prompt_tokens": [
        "test_server_params.py::test_truncate_prompt_tokens_and_prompt_logprobs"],
    "prompt_logprobs": ["test_server_params.py::test_truncate_prompt_tokens_and_prompt_logprobs"],
    "priority": ["test_server_params.py::test_priority_needs_priority_scheduling", REACHES],
    "cache_salt": ["test_server_params.py::test_cache_salt_separates_prefix_cache_hits"],
    "return_tokens_as_token_ids": [
        "test_server_params.py::test_return_tokens_as_token_ids_and_logit_bias"],
    "use_beam_search": ["test_server_params.py::test_beam_search_matches_the_engine"],
    "length_penalty": [REACHES],
    "vllm_xargs": ["test_server_params.py::test_vllm_xargs_names_logits_processors"],
    **{name: ["test_server_params.py::test_structured_outputs_on_completions"]
       for name in ("structured_outputs", "guided_json", "guided_regex", "guided_choice",
                    "guided_grammar")},
    "guided_decoding_backend": [
        "test_server_params.py::test_bad_constraints_are_400_before_a_stream_starts"],
    "guided_whitespace_pattern": [
        "test_server_params.py::test_bad_constraints_are_400_before_a_stream_starts", REACHES],
}
SERVER_FIELD_TESTS = {
    "CompletionRequest": {
        **_SAMPLING_ON_SERVER,
        "prompt": ["test_server.py::test_token_prompts_and_batches"],
        "max_tokens": [REACHES], "logprobs": ["test_server.py::test_completion_logprobs_and_echo"],
        "echo": ["test_server.py::test_completion_logprobs_and_echo"],
        "best_of": ["test_server_errors.py::test_completion_400"],
        "suffix": [REACHES], "add_special_tokens": [REACHES],
    },
    "ChatCompletionRequest": {
        **_SAMPLING_ON_SERVER,
        "messages": ["test_server.py::test_chat_stream_equals_full"],
        "max_tokens": ["test_server.py::test_max_tokens_and_max_completion_tokens"],
        "max_completion_tokens": ["test_server.py::test_max_tokens_and_max_completion_tokens"],
        "logprobs": ["test_server.py::test_chat_logprobs"],
        "top_logprobs": ["test_server.py::test_chat_logprobs"],
        "response_format": ["test_server_params.py::test_response_format_on_chat"],
        "tools": ["test_server_tools.py::test_forced_tool_calls_always_parse",
                  "test_server_tools.py::test_auto_tool_calls_are_parsed_from_the_text"],
        "tool_choice": ["test_server_tools.py::test_forced_tool_calls_always_parse",
                        "test_server_tools.py::test_bad_tool_choices_are_400",
                        "test_server_params.py::test_tool_fields_without_tools"],
        "parallel_tool_calls": ["test_server_params.py::test_tool_fields_without_tools"],
        "reasoning_effort": [
            "test_server_params.py::test_chat_template_needs_trust_and_kwargs_reach_it"],
        "add_generation_prompt": [REACHES], "continue_final_message": [REACHES],
        "add_special_tokens": [REACHES], "echo": [REACHES],
        "chat_template": ["test_server_params.py::test_chat_template_needs_trust_and_kwargs_reach_it"],
        "chat_template_kwargs": [
            "test_server_params.py::test_chat_template_needs_trust_and_kwargs_reach_it"],
    },
    "ChatMessage": {
        "role": ["test_server_errors.py::test_chat_400"],
        "content": ["test_server.py::test_chat_stream_equals_full"],
        "name": [f"{HERE}::test_message_fields_reach_the_template"],
        "tool_calls": [f"{HERE}::test_message_fields_reach_the_template"],
        "tool_call_id": [f"{HERE}::test_message_fields_reach_the_template"],
    },
    "ContentPart": {
        "type": ["test_server_errors.py::test_chat_400"],
        "text": [f"{HERE}::test_message_fields_reach_the_template"],
    },
    "StreamOptions": {
        "include_usage": ["test_server_cli.py::test_serve_sigterm_lets_stream_finish"],
        "continuous_usage_stats": ["test_server_params.py::test_continuous_usage_stats"],
    },
    "TokenizeRequest": {name: ["test_server.py::test_tokenize_detokenize"] for name in
                        ("model", "prompt", "messages", "add_special_tokens",
                         "add_generation_prompt")},
    "DetokenizeRequest": {name: ["test_server.py::test_tokenize_detokenize"]
                          for name in ("model", "tokens")},
}
# The pooling endpoints (protocol_pooling): fields on a pooling model in test_pooling_server.py,
# and every endpoint refuses a generative model whatever its fields say.
_PS = "test_pooling_server.py"
_REFUSED = f"{HERE}::test_pooling_endpoints_refuse_a_generative_model"
_XENC = f"{_PS}::test_cross_encoder_score_rerank_and_classify_match_transformers"
_POOLING_COMMON = {
    "model": [f"{_PS}::test_bad_input_is_a_clear_400", _REFUSED],
    "user": [f"{_PS}::test_openai_client_embeddings_equal_sentence_transformers"],
    "truncate_prompt_tokens": [f"{_PS}::test_embedding_inputs_and_fields", _XENC],
    "priority": [f"{_PS}::test_embedding_inputs_and_fields", _XENC,
                 f"{_PS}::test_pooling_core_honours_priority"],
    "request_id": [f"{_PS}::test_embedding_inputs_and_fields", _XENC],
}
_EMBED_FIELDS = {
    "input": [f"{_PS}::test_embedding_inputs_and_fields", f"{_PS}::test_bad_input_is_a_clear_400"],
    "encoding_format": [f"{_PS}::test_openai_client_embeddings_equal_sentence_transformers",
                        f"{_PS}::test_pooling_score_and_rerank_on_an_embedding_model"],
    "dimensions": [f"{_PS}::test_openai_client_embeddings_equal_sentence_transformers",
                   f"{_PS}::test_serve_pooling_model_two_api_servers_and_clean_exit"],
    "add_special_tokens": [f"{_PS}::test_embedding_inputs_and_fields"],
    "normalize": [f"{_PS}::test_embedding_inputs_and_fields"],
}
_ACTIVATION = {"use_activation": [_XENC, f"{_PS}::test_bad_input_is_a_clear_400"],
               "activation": [_XENC]}
_CHAT = f"{_PS}::test_chat_messages_embed_the_rendered_template"
_CHAT_FIELDS = {**{name: [_CHAT] for name in (
    "messages", "chat_template", "chat_template_kwargs", "add_generation_prompt",
    "continue_final_message", "add_special_tokens", "encoding_format", "dimensions",
    "normalize", "user", "truncate_prompt_tokens", "priority", "request_id")},
    "model": [_CHAT, _REFUSED]}
POOLING_FIELD_TESTS = {
    "EmbeddingRequest": {**_POOLING_COMMON, **_EMBED_FIELDS},
    "EmbeddingChatRequest": _CHAT_FIELDS,
    "PoolingRequest": {**_POOLING_COMMON, **_EMBED_FIELDS, **_ACTIVATION},
    "PoolingChatRequest": {**_CHAT_FIELDS, **_ACTIVATION},
    "ClassificationRequest": {**_POOLING_COMMON, **_ACTIVATION, "input": [_XENC],
                              "add_special_tokens": [_XENC]},
    "ScoreRequest": {**_POOLING_COMMON, **_ACTIVATION, "text_1": [_XENC], "text_2": [_XENC]},
    "RerankRequest": {**_POOLING_COMMON, **_ACTIVATION,
                      **{name: [_XENC] for name in ("query", "documents", "top_n",
                                                    "return_documents")}},
}


def _check_tests_exist(where: str, tests: list[str]) -> None:
    for test in tests:
        file, name = test.split("::")
        source = (TESTS / file).read_text()
        assert re.search(rf"^(async )?def {name}\(", source, re.M), f"{where}: {test} is gone"


def _check_mapping(where: str, fields: set[str], mapping: dict[str, list[str]]) -> None:
    assert set(mapping) == fields, (
        f"{where}: fields without a test: {sorted(fields - set(mapping))}; "
        f"entries for no field: {sorted(set(mapping) - fields)}")
    for field, tests in mapping.items():
        _check_tests_exist(f"{where}.{field}", tests)


def test_every_sampling_field_is_covered():
    fields = {f.name for f in dataclasses.fields(SamplingParams)} - ENGINE_FILLED
    _check_mapping("SamplingParams", fields, SAMPLING_FIELD_TESTS)


def test_every_prompt_key_is_covered():
    keys = set(typing.get_type_hints(TextPrompt)) | set(typing.get_type_hints(TokensPrompt))
    _check_mapping("prompt", keys, PROMPT_KEY_TESTS)


def test_every_server_request_field_is_covered():
    for module, maps in ((protocol, SERVER_FIELD_TESTS), (protocol_pooling, POOLING_FIELD_TESTS)):
        for model_name, mapping in maps.items():
            model = getattr(module, model_name)
            _check_mapping(model_name, set(model.model_fields), mapping)
    # every request model of the pooling endpoints has its map
    requests = {name for name in vars(protocol_pooling)
                if name.endswith("Request") and name != "OpenAIRequest"}
    assert requests == set(POOLING_FIELD_TESTS), requests


# ---- the server's values reach the engine ---------------------------------------------------

class _Capturing:
    """The shared AsyncLLM, recording what each generate call receives."""

    def __init__(self, engine) -> None:
        self._engine = engine
        self.calls: list[tuple[dict, SamplingParams, int]] = []

    def __getattr__(self, name: str):
        return getattr(self._engine, name)

    async def generate(self, prompt, params, request_id, arrival_time=None, priority=0):
        self.calls.append((prompt, params, priority))
        async for out in self._engine.generate(prompt, params, request_id, arrival_time,
                                               priority):
            yield out


@pytest.fixture(scope="module")
def capturing():
    engine = shared_server().engine
    app = build_app(engine, [MODEL_NAME], shutdown_engine_on_exit=False,
                    trust_request_chat_template=True)
    spy = _Capturing(engine)
    app.state.ctx.engine = spy
    thread = ServerThread(app).start()
    yield thread, spy
    thread.stop()


TOKENS = [9906, 1836, 314]
COMPLETION = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 2}
CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
# (endpoint, request fields, check on (prompt dict, SamplingParams, priority)); a check of
# None means the request must be refused with a 400 naming the first field.
REACH_CASES = [
    ("c", {"n": 2}, lambda p, sp, pr: sp.n == 2),
    ("c", {"temperature": 0.5}, lambda p, sp, pr: sp.temperature == 0.5),
    ("c", {"top_p": 0.9, "temperature": 1.0}, lambda p, sp, pr: sp.top_p == 0.9),
    ("c", {"presence_penalty": 0.5}, lambda p, sp, pr: sp.presence_penalty == 0.5),
    ("c", {"frequency_penalty": -0.5}, lambda p, sp, pr: sp.frequency_penalty == -0.5),
    ("c", {"seed": 7}, lambda p, sp, pr: sp.seed == 7),
    ("c", {"stop": ["xyz"]}, lambda p, sp, pr: sp.stop == ["xyz"]),
    ("c", {"top_k": 5, "temperature": 1.0}, lambda p, sp, pr: sp.top_k == 5),
    ("c", {"min_p": 0.1, "temperature": 1.0}, lambda p, sp, pr: sp.min_p == 0.1),
    ("c", {"repetition_penalty": 1.2}, lambda p, sp, pr: sp.repetition_penalty == 1.2),
    ("c", {"min_tokens": 1}, lambda p, sp, pr: sp.min_tokens == 1),
    ("c", {"ignore_eos": True}, lambda p, sp, pr: sp.ignore_eos),
    ("c", {"stop_token_ids": [5]}, lambda p, sp, pr: sp.stop_token_ids == [5]),
    ("c", {"include_stop_str_in_output": True},
     lambda p, sp, pr: sp.include_stop_str_in_output),
    ("c", {"skip_special_tokens": False}, lambda p, sp, pr: not sp.skip_special_tokens),
    ("c", {"spaces_between_special_tokens": False},
     lambda p, sp, pr: not sp.spaces_between_special_tokens),
    ("c", {"max_tokens": 3}, lambda p, sp, pr: sp.max_tokens == 3),
    ("c", {"priority": 0}, lambda p, sp, pr: pr == 0),
    ("c", {"prompt": "Hello", "add_special_tokens": False},
     lambda p, sp, pr: p["prompt_token_ids"] == shared_server().engine.tokenizer.encode(
         "Hello", add_special_tokens=False)),
    ("c", {"prompt": TOKENS, "cache_salt": "s"},
     lambda p, sp, pr: p["cache_salt"] == "s" and p["prompt_token_ids"] == TOKENS),
    ("c", {"suffix": "tail"}, None),
    ("c", {"length_penalty": 2.0}, None),  # only with use_beam_search
    ("c", {"guided_whitespace_pattern": " "}, None),
    ("c", {"guided_json": {"type": "object"}, "guided_whitespace_pattern": "[ ]?"},
     lambda p, sp, pr: sp.structured_outputs.whitespace_pattern == "[ ]?"),
    ("h", {"add_generation_prompt": False},
     lambda p, sp, pr: p["prompt_token_ids"][-1] != _default_chat_ids()[-1]),
    ("h", {"messages": [{"role": "user", "content": "Hi"},
                        {"role": "assistant", "content": "Hel"}],
           "continue_final_message": True, "add_generation_prompt": False},
     lambda p, sp, pr: shared_server().engine.tokenizer.decode(
         p["prompt_token_ids"]).endswith("Hel")),
    ("h", {"add_special_tokens": True},
     lambda p, sp, pr: p["prompt_token_ids"] == shared_server().engine.tokenizer.encode(
         shared_server().engine.tokenizer.apply_chat_template(
             CHAT["messages"], add_generation_prompt=True, tokenize=False),
         add_special_tokens=True)),
    ("h", {"messages": [{"role": "user", "content": "Hi"},
                        {"role": "assistant", "content": "Once upon"}],
           "echo": True, "continue_final_message": True, "add_generation_prompt": False},
     lambda p, sp, pr: True),
]


def _default_chat_ids() -> list[int]:
    tok = shared_server().engine.tokenizer
    return list(tok.apply_chat_template([{"role": "user", "content": "Hi"}],
                                        add_generation_prompt=True, tokenize=True))


@pytest.mark.parametrize("endpoint,fields,check", REACH_CASES,
                         ids=[f"{e}-{next(iter(f))}" for e, f, _ in REACH_CASES])
def test_server_field_reaches_the_engine(capturing, endpoint, fields, check):
    thread, spy = capturing
    path, base = (("/v1/completions", COMPLETION) if endpoint == "c"
                  else ("/v1/chat/completions", CHAT))
    spy.calls.clear()
    response = httpx.post(thread.base_url + path, json={**base, **fields}, timeout=120)
    if check is None:
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        name = next(iter(fields))
        assert name in (error["param"] or "") + error["message"], error
        return
    assert response.status_code == 200, response.text
    prompt, params, priority = spy.calls[-1]
    assert check(prompt, params, priority), (fields, prompt, params)
    if fields.get("echo"):
        assert response.json()["choices"][0]["message"]["content"].startswith("Once upon")


def test_message_fields_reach_the_template(capturing):
    thread, spy = capturing
    template = ("{% for m in messages %}[{{ m['role'] }}|{{ m.get('name', '') }}|"
                "{{ m.get('tool_call_id', '') }}|{{ m.get('tool_calls', '') }}|"
                "{{ m['content'] }}]{% endfor %}")
    messages = [
        {"role": "user", "name": "alice", "content": [{"type": "text", "text": "part one"},
                                                      {"type": "text", "text": "part two"}]},
        {"role": "assistant", "content": "",
         "tool_calls": [{"id": "c1", "type": "function",
                         "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
    ]
    response = httpx.post(thread.base_url + "/v1/chat/completions", timeout=120,
                          json={**CHAT, "messages": messages, "chat_template": template})
    assert response.status_code == 200, response.text
    rendered = shared_server().engine.tokenizer.decode(spy.calls[-1][0]["prompt_token_ids"])
    assert "|alice|" in rendered and "part one\npart two" in rendered
    assert "|c1|" in rendered and "'name': 'f'" in rendered


def test_user_is_accepted_as_in_vllm(capturing):
    """OpenAI's `user` names the end user for abuse monitoring; vLLM accepts and ignores it."""
    thread, spy = capturing
    response = httpx.post(thread.base_url + "/v1/completions", timeout=120,
                          json={**COMPLETION, "user": "alice"})
    assert response.status_code == 200


def test_pooling_endpoints_refuse_a_generative_model(capturing):
    """Every pooling endpoint on a generating model: a 400 naming the model's runner."""
    thread, _ = capturing
    for path, body in (("/v1/embeddings", {"input": "x", "encoding_format": "float",
                                           "dimensions": 8, "user": "u"}),
                       ("/pooling", {"input": "x"}), ("/classify", {"input": "x"}),
                       ("/score", {"text_1": "a", "text_2": "b"}), ("/v1/score", {"text_1": "a",
                                                                               "text_2": "b"}),
                       ("/rerank", {"query": "a", "documents": ["b"]}),
                       ("/v1/rerank", {"query": "a", "documents": ["b"]}),
                       ("/v2/rerank", {"query": "a", "documents": ["b"]}),
                       ("/v1/embeddings", {"messages": [{"role": "user", "content": "x"}]}),
                       ("/pooling", {"messages": [{"role": "user", "content": "x"}]})):
        response = httpx.post(thread.base_url + path, json={"model": MODEL_NAME, **body},
                              timeout=60)
        assert response.status_code == 400, (path, response.text)
        error = response.json()["error"]
        assert error["code"] == "model_not_supported" and "runner 'generate'" in error["message"]


def test_detokenize_false_and_ignore_eos():
    """detokenize=False: token ids only, no text; ignore_eos runs to max_tokens."""
    from ember.sampling_params import SamplingParams as SP

    async def run() -> list:
        outs = []
        engine = shared_server().engine
        for i, params in enumerate([SP(temperature=0, max_tokens=5, detokenize=False,
                                       ignore_eos=True)]):
            async for out in engine.generate({"prompt_token_ids": TOKENS}, params, f"cov-{i}"):
                final = out
            outs.append(final)
        return outs

    import asyncio

    (out,) = asyncio.run(run())
    assert out.outputs[0].text == "" and len(out.outputs[0].token_ids) == 5
    assert out.outputs[0].finish_reason == "length"
