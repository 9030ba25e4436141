"""LLM(...) and LLM.chat/generate parameters with vLLM's meaning: seed=None, use_tqdm=<callable>,
OpenAI text content parts, chat_template, chat_template_kwargs, tools, add_generation_prompt,
continue_final_message, and clear refusals (non-text parts, mm_processor_kwargs, conflicting
flags). Run on a tiny random model with the default model's tokenizer and chat template.
"""

from __future__ import annotations

import pytest
from text_model import PROMPT, make_text_model, text_args

from ember import LLM, EngineArgs, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
TEMPLATE = ("{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
            "{% if tools %}[tools:{{ tools | length }}]{% endif %}"
            "{% if greeting is defined %}[{{ greeting }}]{% endif %}"
            "{% if add_generation_prompt %}[assistant]{% endif %}")


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return make_text_model(tmp_path_factory.mktemp("chat"))


@pytest.fixture(scope="module")
def llm(model_path):
    llm = LLM(model_path, tokenizer=text_args(model_path).tokenizer, max_model_len=256)
    yield llm
    llm.shutdown()


def test_text_content_parts_equal_a_string(llm):
    parts = [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
             {"role": "user", "content": [{"type": "text", "text": "Hi"},
                                          {"type": "text", "text": "there"}]}]
    plain = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi\nthere"}]
    [a] = llm.chat(parts, GREEDY)
    [b] = llm.chat(plain, GREEDY)
    tok = llm.get_tokenizer()
    expected = tok.apply_chat_template(plain, tokenize=False, add_generation_prompt=True)
    assert a.prompt == b.prompt == expected
    assert a.prompt_token_ids == b.prompt_token_ids == tok.encode(expected, add_special_tokens=False)
    assert a.outputs[0].token_ids == b.outputs[0].token_ids


@pytest.mark.parametrize("part,name", [
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}, "image_url"),
    ({"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}, "input_audio"),
    ({"type": "text"}, "text"),
])
def test_non_text_parts_refused(llm, part, name):
    with pytest.raises(ValueError, match=name):
        llm.chat([{"role": "user", "content": [{"type": "text", "text": "look"}, part]}], GREEDY)


def test_chat_template_kwargs_tools_and_generation_prompt(llm):
    messages = [{"role": "user", "content": "Hi"}]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    [out] = llm.chat(messages, GREEDY, chat_template=TEMPLATE, tools=tools,
                     chat_template_kwargs={"greeting": "hello"})
    assert out.prompt == "[user]Hi[tools:1][hello][assistant]"
    [out] = llm.chat(messages, GREEDY, chat_template=TEMPLATE, add_generation_prompt=False)
    assert out.prompt == "[user]Hi"
    # The "openai" content format hands the template a list of text parts.
    parts_template = "{% for m in messages %}{% for p in m.content %}<{{ p.text }}>{% endfor %}{% endfor %}"
    [out] = llm.chat([{"role": "user", "content": [{"type": "text", "text": "a"},
                                                    {"type": "text", "text": "b"}]}],
                     GREEDY, chat_template=parts_template, chat_template_content_format="openai")
    assert out.prompt == "<a><b>"


def test_continue_final_message(llm):
    messages = [{"role": "user", "content": "Count to three."},
                {"role": "assistant", "content": "One, two,"}]
    [out] = llm.chat(messages, GREEDY, add_generation_prompt=False, continue_final_message=True)
    assert out.prompt.endswith("One, two,")  # the assistant turn is left open
    [closed] = llm.chat(messages, GREEDY, add_generation_prompt=False)
    assert not closed.prompt.endswith("One, two,")
    with pytest.raises(ValueError, match="continue_final_message"):
        llm.chat(messages, GREEDY, continue_final_message=True)  # add_generation_prompt too
    with pytest.raises(ValueError, match="mm_processor_kwargs"):
        llm.chat(messages[:1], GREEDY, mm_processor_kwargs={"num_crops": 2})


class RecordingBar:
    """A progress-bar factory as vLLM's use_tqdm callable is used: called once, updated."""

    calls: list[dict] = []

    def __init__(self, **kwargs) -> None:
        RecordingBar.calls.append(kwargs)
        self.updates = 0
        self.closed = False
        RecordingBar.last = self

    def update(self, n: int = 1) -> None:
        self.updates += n

    def close(self) -> None:
        self.closed = True


def test_use_tqdm_callable(llm):
    RecordingBar.calls = []
    outs = llm.generate([PROMPT, "Hello"], GREEDY, use_tqdm=RecordingBar)
    assert len(outs) == 2
    assert RecordingBar.calls == [{"total": 2, "desc": "Processed prompts", "dynamic_ncols": True}]
    assert RecordingBar.last.updates == 2 and RecordingBar.last.closed
    llm.chat([{"role": "user", "content": "Hi"}], GREEDY, use_tqdm=RecordingBar)
    assert len(RecordingBar.calls) == 2 and RecordingBar.calls[-1]["total"] == 1


def test_seed_none_is_unseeded(model_path):
    """seed=None is accepted (vLLM's: nondeterministic); unseeded requests then differ between
    two engines, while seed=0 engines agree."""
    tokenizer = text_args(model_path).tokenizer
    sample = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    runs = {}
    for name, seed in [("none_a", None), ("none_b", None), ("zero_a", 0), ("zero_b", 0)]:
        llm = LLM(model_path, tokenizer=tokenizer, max_model_len=64, seed=seed)
        runs[name] = llm.generate([PROMPT], sample)[0].outputs[0].token_ids
        llm.shutdown()
    assert runs["zero_a"] == runs["zero_b"]
    assert runs["none_a"] != runs["none_b"]
    with pytest.raises(ValueError, match="seed"):
        EngineArgs(seed="7").validate()


def test_llm_generate_prompt_fields(llm):
    """cache_salt, refused fields and truncate_prompt_tokens through LLM.generate (the engine
    tests cover LLMEngine and AsyncLLM)."""
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    text = "(LLM salt) " + PROMPT
    hits = [llm.generate([{"prompt": text, **extra}], params)[0].num_cached_tokens > 0
            for extra in ({}, {}, {"cache_salt": "s"}, {"cache_salt": "s"})]
    assert hits == [False, True, False, True]
    with pytest.raises(ValueError, match="multi_modal_data"):
        llm.generate([{"prompt": text, "multi_modal_data": {"image": "x"}}], params)
    ids = llm.get_tokenizer().encode(text)
    [cut, direct] = llm.generate(
        [text, {"prompt_token_ids": ids[-7:]}],
        [SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, truncate_prompt_tokens=7),
         params])
    assert cut.prompt_token_ids == ids[-7:]
    assert cut.outputs[0].token_ids == direct.outputs[0].token_ids
