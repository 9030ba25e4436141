"""Structured outputs' `structural_tag` on the default model: xgrammar's format (a required tag
whose content is a JSON schema) gives a tag whose JSON validates; vLLM's older format
(`structures` + `triggers`) runs through both grammar backends, free text until a trigger.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from ember import LLM, SamplingParams
from ember.sampling_params import StructuredOutputsParams

CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"], "additionalProperties": False}


@pytest.fixture(scope="module")
def llm():
    return LLM(max_model_len=512)


def _generate(llm, tag: dict, **params):
    structured = StructuredOutputsParams(structural_tag=json.dumps(tag))
    out = llm.chat([{"role": "user", "content": "What is the weather in Paris?"}],
                   SamplingParams(temperature=0, structured_outputs=structured, **params),
                   use_tqdm=False)
    return out[0].outputs[0]


def test_required_tag_holds_valid_json(llm):
    tag = {"type": "structural_tag", "format": {
        "type": "triggered_tags", "triggers": ["<function="], "at_least_one": True,
        "stop_after_first": True,
        "tags": [{"begin": "<function=get_weather>", "end": "</function>",
                  "content": {"type": "json_schema", "json_schema": CITY}}]}}
    out = _generate(llm, tag, max_tokens=80)
    match = re.search(r"<function=get_weather>(.*)</function>", out.text, re.DOTALL)
    assert match, out.text
    jsonschema.validate(json.loads(match.group(1)), CITY)
    assert out.finish_reason == "stop"


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
def test_triggered_structures_run_on_both_backends(llm, backend):
    if backend != "xgrammar":
        llm = LLM(max_model_len=512, structured_outputs_config={"backend": backend})
    tag = {"type": "structural_tag", "triggers": ["<function="],
           "structures": [{"begin": "<function=get_weather>", "schema": CITY,
                           "end": "</function>"}]}
    out = _generate(llm, tag, max_tokens=24)
    unconstrained = llm.chat([{"role": "user", "content": "What is the weather in Paris?"}],
                             SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    # The model never writes the trigger, so nothing is constrained: the free text is the same.
    assert "<function=" not in unconstrained[0].outputs[0].text
    assert out.text == unconstrained[0].outputs[0].text
