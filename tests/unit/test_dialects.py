"""Structured-output dialects: each transform against its server's rules.

* ``openai``: OpenAI's strict subset, checked rule by rule (object root, closed objects,
  every property required, optional ones nullable, supported keywords only, nesting and
  size limits), and a strict reply with nulls for absent optionals is read back as the
  reply it stands for;
* ``vllm``/``sglang``/``ollama``/``llama_cpp``: compiled by llguidance (one of vLLM's and
  SGLang's backends; it installs here from PyPI), and random replies the per-turn schema
  admits are accepted by the compiled grammar byte by byte.
xgrammar and llama.cpp's own converter run in ``make test-models``
(``tests/models/test_converters.py``): they need torch or a C++ build.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import jsonschema
import llguidance
import pytest

from investigation.llm import dialects
from investigation.loop.contract import read_reply
from tests.schema_sampler import sample
from tests.turn_schemas import representative_schemas

SCHEMAS = representative_schemas()

#: OpenAI's documented limits for strict schemas.
OPENAI_MAX_PROPERTIES = 5000
OPENAI_MAX_NESTING = 10
OPENAI_MAX_ENUM_VALUES = 1000


def _objects(schema: Any, depth: int = 1) -> list[tuple[dict[str, Any], int]]:
    found: list[tuple[dict[str, Any], int]] = []
    if isinstance(schema, dict):
        if schema.get("type") == "object":
            found.append((schema, depth))
            depth += 1
        for key, value in schema.items():
            if key == "properties":
                for sub in value.values():
                    found += _objects(sub, depth)
            elif key in ("items", "anyOf"):
                for sub in value if isinstance(value, list) else [value]:
                    found += _objects(sub, depth)
    return found


def _nodes(schema: Any) -> list[dict[str, Any]]:
    out = []
    if isinstance(schema, dict):
        out.append(schema)
        for key, value in schema.items():
            if key == "properties":
                for sub in value.values():
                    out += _nodes(sub)
            elif key in ("items", "anyOf"):
                for sub in value if isinstance(value, list) else [value]:
                    out += _nodes(sub)
    return out


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_openai_strict_subset_rule_by_rule(name: str) -> None:
    fmt = dialects.response_format("openai", SCHEMAS[name], "investigation_reply")
    assert fmt is not None and fmt["type"] == "json_schema"
    assert fmt["json_schema"]["strict"] is True
    assert fmt["json_schema"]["name"] == "investigation_reply"
    strict = fmt["json_schema"]["schema"]
    # 1. the root is an object, not anyOf
    assert strict["type"] == "object" and "anyOf" not in strict
    objects = _objects(strict)
    for obj, depth in objects:
        # 2. every object is closed and 3. lists every property as required
        assert obj["additionalProperties"] is False
        assert obj["required"] == list(obj["properties"])
        # 4. nesting at most 10 levels
        assert depth <= OPENAI_MAX_NESTING
    # 5. at most 5000 properties, 1000 enum values
    assert sum(len(o["properties"]) for o, _ in objects) <= OPENAI_MAX_PROPERTIES
    nodes = _nodes(strict)
    assert sum(len(n.get("enum", [])) for n in nodes) <= OPENAI_MAX_ENUM_VALUES
    # 6. only supported keywords (no minLength/maxLength, no defaults, no titles)
    for node in nodes:
        assert set(node) <= dialects.OPENAI_STRICT_KEYWORDS, set(node) - \
            dialects.OPENAI_STRICT_KEYWORDS
    jsonschema.Draft202012Validator.check_schema(strict)


def _nullify(reply: dict[str, Any], strict: dict[str, Any]) -> dict[str, Any]:
    """``reply`` as a strict-mode model sends it: absent optional values as null."""
    def fill(value: Any, schema: dict[str, Any]) -> Any:
        for option in schema.get("anyOf", [schema]):
            candidate = value
            if option.get("type") == "object" and isinstance(value, dict):
                if not set(value) <= set(option["properties"]):
                    continue
                candidate = {k: fill(value[k], option["properties"][k]) if k in value
                             else None for k in option["properties"]}
            elif option.get("type") == "array" and isinstance(value, list):
                candidate = [fill(v, option["items"]) for v in value]
            if jsonschema.Draft202012Validator(option).is_valid(candidate):
                return candidate
        return value
    return dict(fill(reply, strict))


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_a_strict_reply_with_nulls_reads_back_as_the_reply(name: str) -> None:
    schema = SCHEMAS[name]
    strict = dialects.openai_strict(schema)
    rng = random.Random(name)
    for _ in range(30):
        reply = sample(schema, rng)
        sent = _nullify(reply, strict)
        jsonschema.validate(sent, strict)
        parsed, _ = read_reply(json.dumps(sent))
        assert parsed.model_dump(mode="json", exclude_none=True) == \
            read_reply(json.dumps(reply))[0].model_dump(mode="json", exclude_none=True)


BYTES = llguidance.LLTokenizer("byte")


def _accepts(grammar: str, text: str) -> bool:
    matcher = llguidance.LLMatcher(BYTES, grammar)
    tokens = BYTES.tokenize_bytes(text.encode("utf-8"))
    return matcher.consume_tokens(tokens) and matcher.is_accepting()


@pytest.mark.parametrize("dialect", ["vllm", "sglang", "ollama", "llama_cpp", "openai"])
@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_llguidance_compiles_each_dialect_and_accepts_its_replies(dialect: str,
                                                                  name: str) -> None:
    fmt = dialects.response_format(dialect, SCHEMAS[name], "investigation_reply")
    assert fmt is not None
    schema = fmt["schema"] if "schema" in fmt else fmt["json_schema"]["schema"]
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        schema, defaults={"whitespace_flexible": False})
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    assert not is_error, messages
    rng = random.Random(f"{dialect}-{name}")
    for _ in range(5):
        reply = sample(SCHEMAS[name], rng)
        if dialect == "openai":
            reply = _nullify(reply, schema)
        text = json.dumps(reply, separators=(",", ":"), ensure_ascii=False)
        assert _accepts(grammar, text), text
    # and it refuses what the schema refuses: an unknown action
    bad = sample(SCHEMAS[name], rng)
    bad["next"] = {"action": "write_file", "reason": "x"}
    assert not _accepts(grammar, json.dumps(bad, separators=(",", ":")))


def test_grammar_dialects_cap_lengths_and_enumerate_small_integer_ranges() -> None:
    schema = next(iter(SCHEMAS.values()))
    friendly = dialects.grammar_friendly(schema, 1000)
    text = json.dumps(friendly)
    assert '"maxLength": 4000' not in text
    lengths = [n["maxLength"] for n in _nodes(friendly) if "maxLength" in n]
    assert lengths and max(lengths) <= 1000
    for node in _nodes(friendly):
        if node.get("type") == "integer":
            assert not ("minimum" in node and "maximum" in node)  # written as an enum
    capped = dialects.response_format("vllm", schema, "r", max_string_chars=300)
    assert capped is not None
    lengths = [n["maxLength"] for n in _nodes(capped["json_schema"]["schema"])
               if "maxLength" in n]
    assert max(lengths) <= 300


def test_dialect_names_and_aliases() -> None:
    assert dialects.canonical_dialect("json_schema") == "openai"
    assert dialects.canonical_dialect("json_object_schema") == "llama_cpp"
    assert dialects.response_format("none", {}, "r") is None
    assert dialects.response_format("json_object", {}, "r") == {"type": "json_object"}
    with pytest.raises(ValueError):
        dialects.canonical_dialect("grammar")


def test_representative_schemas_are_stored_with_the_tests() -> None:
    # The schemas come from real contexts (tests/turn_schemas.py rebuilds them); they
    # cover a first turn, a turn with a pending result and support, and a closing turn.
    assert set(SCHEMAS) >= {"first_turn", "pending_with_support", "closing"}
    assert Path(__file__).resolve().parents[1].joinpath("turn_schemas.py").exists()


def test_openai_enum_limits_count_only_the_enums_that_stay_in_the_schema() -> None:
    # A dict ``additionalProperties`` becomes ``false``: its 600 enum values leave the
    # schema and must not push the 700 that stay over the limit of 1000.
    schema = {"type": "object",
              "properties": {"a": {"type": "string", "enum": [f"a{i}" for i in range(700)]}},
              "required": ["a"],
              "additionalProperties": {"type": "string",
                                       "enum": [f"b{i}" for i in range(600)]}}
    strict = dialects.openai_strict(schema)
    assert strict["additionalProperties"] is False
    assert strict["properties"]["a"] == schema["properties"]["a"]
    # Both kept (a nested object's open map dropped nothing): together they are widened.
    nested = {"type": "object", "properties": {
        "a": schema["properties"]["a"],
        "b": {"type": "string", "enum": [f"b{i}" for i in range(600)]}},
        "required": ["a", "b"], "additionalProperties": False}
    widened = dialects.openai_strict(nested)
    assert sum(len(p.get("enum", [])) for p in widened["properties"].values()) \
        <= OPENAI_MAX_ENUM_VALUES
