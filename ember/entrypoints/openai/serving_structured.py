"""A request's structured-output fields -> StructuredOutputsParams (vLLM's mapping).

Sources, at most one constraint in all: vLLM's `structured_outputs` object; the older
`guided_json` / `guided_regex` / `guided_choice` / `guided_grammar` fields (with
`guided_whitespace_pattern` as an option); chat's `response_format` (`json_schema` -> its schema,
`json_object` -> any JSON object, `text` -> none). `guided_decoding_backend` may only name the
backend the engine runs (vLLM v1 chooses it per engine). A malformed or uncompilable constraint
is a 400 naming the field, checked before the request is added (so a stream never starts).
"""

from __future__ import annotations

from typing import Any

from ember.entrypoints.openai.errors import OpenAIError
from ember.sampling_params import StructuredOutputsParams

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}


def structured_outputs_from(req: Any, engine_backend: str) -> StructuredOutputsParams | None:
    """The request's constraint, or None; OpenAIError(400) naming the field when invalid."""
    found: list[tuple[str, dict[str, Any]]] = []
    if req.structured_outputs is not None:
        found.append(("structured_outputs", dict(req.structured_outputs)))
    for field, key in _GUIDED.items():
        value = getattr(req, field)
        if value is not None:
            found.append((field, {key: value}))
    response_format = getattr(req, "response_format", None)
    if response_format is not None:
        from_format = _from_response_format(response_format)
        if from_format is not None:
            found.append(("response_format", from_format))
    if req.guided_decoding_backend is not None and req.guided_decoding_backend not in (
            engine_backend, "auto"):
        raise OpenAIError(
            f"guided_decoding_backend {req.guided_decoding_backend!r} differs from this "
            f"server's structured-output backend {engine_backend!r} (chosen per server with "
            "--structured-outputs-config)", 400, param="guided_decoding_backend")
    if not found:
        if req.guided_whitespace_pattern is not None:
            raise OpenAIError("guided_whitespace_pattern needs a JSON constraint", 400,
                              param="guided_whitespace_pattern")
        return None
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise OpenAIError(f"give one structured-output constraint, got {names}", 400,
                          param=found[1][0])
    field, kwargs = found[0]
    if req.guided_whitespace_pattern is not None:
        kwargs.setdefault("whitespace_pattern", req.guided_whitespace_pattern)
    try:
        return StructuredOutputsParams(**kwargs)
    except (TypeError, ValueError) as exc:
        raise OpenAIError(f"{field}: {exc}", 400, param=field) from None


def _from_response_format(fmt: dict[str, Any]) -> dict[str, Any] | None:
    kind = fmt.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise OpenAIError("response_format json_schema needs json_schema.schema (an "
                              "object)", 400, param="response_format")
        return {"json": schema}
    if kind == "structural_tag":
        import json

        return {"structural_tag": json.dumps({k: v for k, v in fmt.items() if k != "type"})}
    raise OpenAIError(f"response_format type {kind!r} is not one of text, json_object, "
                      "json_schema, structural_tag", 400, param="response_format")
