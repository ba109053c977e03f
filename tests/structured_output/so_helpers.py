"""Seeded workloads of the structured-output tests: random JSON schemas and regexes, and a
FakeRunner engine over the demo model's tokenizer (512 tokens).

The schemas are bounded (strings with maxLength, integers with a range, floats from an enum,
arrays with maxItems) so that any allowed continuation ends: with unbounded numbers or strings a
model that keeps choosing digits would hit max_tokens inside the grammar, which says nothing
about the constraint."""
from __future__ import annotations

import json
import random
import re
from pathlib import Path

import jsonschema

DEMO_HF = str(Path(__file__).resolve().parents[2].parent / "shared" / "models" / "stories260K" / "hf")
DEMO_EOS = frozenset({2})
VOCAB = 512

REGEXES = [
    r"[a-z]{3,6}",
    r"[0-9]{1,3}(\.[0-9]{1,2})?",
    r"(yes|no|maybe)",
    r"[A-Z][a-z]{1,5} [A-Z][a-z]{1,5}",
    r"\d{4}-\d{2}-\d{2}",
    r"(cat|dog)s? (ran|sat)",
    r"[a-f0-9]{8}",
    r"#[0-9A-F]{6}",
    r"(ab|cd){1,4}x",
    r"[a-z]{1,8}@[a-z]{2,5}\.(com|org)",
]


def _value(rng: random.Random, depth: int) -> dict:
    kinds = ["string", "integer", "float_enum", "enum", "boolean", "array"]
    if depth < 2:
        kinds.append("object")
    kind = rng.choice(kinds)
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(1, 6)}
    if kind == "integer":
        lo = rng.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 500)}
    if kind == "float_enum":
        return {"type": "number", "enum": [round(rng.uniform(-10, 10), 2) for _ in range(3)]}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", "cat", "dog", "a b", "x\"y"], 3)}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "array":
        return {"type": "array", "items": _value(rng, depth + 1), "maxItems": rng.randint(1, 3)}
    return _object(rng, depth + 1)


def _object(rng: random.Random, depth: int) -> dict:
    names = rng.sample(["id", "name", "age", "tags", "pos", "kind", "ok", "score", "child"], rng.randint(1, 4))
    props = {n: _value(rng, depth) for n in names}
    return {"type": "object", "properties": props, "required": sorted(props),
            "additionalProperties": False}


def random_schemas(n: int = 20, seed: int = 14) -> list[dict]:
    rng = random.Random(seed)
    return [_object(rng, 0) for _ in range(n)]


def check_json(text: str, schema: dict) -> None:
    jsonschema.validate(json.loads(text), schema)


def check_regex(text: str, regex: str) -> None:
    assert re.fullmatch(regex, text), (regex, text)
