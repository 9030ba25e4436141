"""JSON schemas of real-world shapes for the structured-outputs tests, generated from a seed.

Every schema keeps outputs short (strings have maxLength, an enum, a pattern or a bounded format;
arrays have maxItems; numbers are bounded), so a small model finishes each by the grammar's end
well within max_tokens. Shapes: flat records, nested objects, arrays of objects with bounds,
enums and consts, anyOf / nullable types, $ref into $defs, string formats and patterns, integers
with (exclusive) bounds, optional properties.
"""

from __future__ import annotations

import random
from typing import Any

NAMES = ["id", "name", "title", "status", "count", "price", "email", "tags", "owner", "created",
         "score", "active", "kind", "level", "city", "code", "items", "note", "rank", "unit"]
FORMATS = ["uuid"]  # bounded; checked by jsonschema without extra packages (its ipv4 and date
# checks refuse leading zeros and year 0000, which the backends' format grammars allow)
PATTERNS = [r"^[A-Z]{3}-\d{2}$", r"^[a-z]{2,5}$", r"^\d{4}$", r"^(red|green|blue)$",
            r"^[A-F0-9]{6}$", r"^v\d\.\d$"]
WORDS = ["alpha", "beta", "gamma", "open", "closed", "pending", "low", "high", "small", "large"]


def _string(rng: random.Random) -> dict[str, Any]:
    pick = rng.randrange(5)
    if pick == 0:
        return {"type": "string", "enum": rng.sample(WORDS, rng.randint(2, 4))}
    if pick == 1:
        return {"type": "string", "pattern": rng.choice(PATTERNS)}
    if pick == 2:
        return {"type": "string", "format": rng.choice(FORMATS)}
    return {"type": "string", "minLength": rng.randint(0, 2), "maxLength": rng.randint(3, 6)}


def _number(rng: random.Random) -> dict[str, Any]:
    # Integers only: a "number" may take as many fraction digits as the model likes (both
    # backends allow them), so its output has no bound.
    low = rng.randint(-50, 50)
    schema: dict[str, Any] = {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 500)}
    if rng.random() < 0.3:
        schema["exclusiveMinimum"] = schema.pop("minimum")
    return schema


def _leaf(rng: random.Random) -> dict[str, Any]:
    pick = rng.randrange(9)
    if pick < 3:
        return _string(rng)
    if pick < 5:
        return _number(rng)
    if pick == 5:
        return {"type": "boolean"}
    if pick == 6:
        return {"anyOf": [_string(rng), _number(rng)]}
    if pick == 7:
        return {"type": ["string", "null"], "maxLength": rng.randint(2, 8)}
    return {"const": rng.choice(WORDS)}


def _array(rng: random.Random, depth: int) -> dict[str, Any]:
    low = rng.randint(0, 1)
    items = _object(rng, depth + 1, max_props=2) if depth < 1 and rng.random() < 0.4 else _leaf(rng)
    return {"type": "array", "items": items, "minItems": low, "maxItems": low + rng.randint(0, 1)}


def _object(rng: random.Random, depth: int = 0, max_props: int = 3) -> dict[str, Any]:
    names = rng.sample(NAMES, rng.randint(1, max_props))
    props: dict[str, Any] = {}
    for name in names:
        roll = rng.random()
        if depth < 2 and roll < 0.15:
            props[name] = _object(rng, depth + 1, max_props=2)
        elif depth < 2 and roll < 0.3:
            props[name] = _array(rng, depth)
        else:
            props[name] = _leaf(rng)
    required = [n for n in names if rng.random() < 0.8] or names[:1]
    return {"type": "object", "properties": props, "required": required,
            "additionalProperties": False}


def _with_refs(rng: random.Random) -> dict[str, Any]:
    """A record whose parts are shared definitions (`$ref` into `$defs`)."""
    address = {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 10},
        "zip": {"type": "string", "pattern": r"^\d{5}$"}}, "required": ["city", "zip"],
        "additionalProperties": False}
    person = {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "home": {"$ref": "#/$defs/address"}}, "required": ["name", "age", "home"],
        "additionalProperties": False}
    top: dict[str, Any] = {"$defs": {"address": address, "person": person}, "type": "object",
                           "additionalProperties": False}
    if rng.random() < 0.5:
        top["properties"] = {"owner": {"$ref": "#/$defs/person"},
                             "count": _number(rng)}
        top["required"] = ["owner", "count"]
    else:
        top["properties"] = {"people": {"type": "array", "items": {"$ref": "#/$defs/person"},
                                        "minItems": 1, "maxItems": 1},
                             "office": {"$ref": "#/$defs/address"}}
        top["required"] = ["people", "office"]
    return top


def generate_schemas(count: int = 210, seed: int = 0) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    schemas = []
    for i in range(count):
        if i % 10 == 0:
            schemas.append(_with_refs(rng))
        elif i % 10 == 1:
            schemas.append({"type": "array", "items": _object(rng, 1, max_props=2),
                            "minItems": 1, "maxItems": 2})
        elif i % 10 == 2:
            schemas.append({"anyOf": [_object(rng, 1, max_props=2), _object(rng, 1, max_props=2)]})
        else:
            schemas.append(_object(rng))
    return schemas
