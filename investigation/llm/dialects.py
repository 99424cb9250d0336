"""Structured-output dialects: the per-turn reply schema in the form each server compiles.

The per-turn schema (:mod:`investigation.loop.reply_schema`) is one JSON Schema; servers
differ in how they take a schema and in the subset their grammar converters compile. A
dialect is a small pure transform plus the ``response_format`` it is sent in:

=============  ==========================================  ============================
dialect        ``response_format``                         schema transform
=============  ==========================================  ============================
``openai``     ``{"type": "json_schema", "json_schema":    :func:`openai_strict`: OpenAI's
(alias         {"name", "schema", "strict": true}}``       strict subset (object root,
``json_schema``)                                           every property required,
                                                           optional ones nullable, no
                                                           length keywords)
``llama_cpp``  ``{"type": "json_object", "schema"}``       :func:`grammar_friendly`:
(alias                                                     string lengths capped (1000
``json_object_                                             by default), bounded integer
schema``)                                                  ranges as enums
``ollama``     ``{"type": "json_schema", "json_schema":    :func:`grammar_friendly` (Ollama
               {"name", "schema"}}``                       compiles it into its ``format``
                                                           with llama.cpp's converter)
``vllm``,      ``{"type": "json_schema", "json_schema":    none: xgrammar, outlines and
``sglang``     {"name", "schema"}}``                       llguidance take the whole subset
``json_object``  ``{"type": "json_object"}``               no schema is sent
``none``       not sent                                    no schema is sent
=============  ==========================================  ============================

A transform narrows, re-spells or widens the schema; it never adds a rule the validator
does not have. Where a converter or an API cannot take a rule, the transform drops it and
the validator alone enforces it: ``openai`` drops length keywords, widens enums past
OpenAI's limits to plain strings (:func:`_fit_openai_enums`) and may send an absent
optional value as ``null`` (the reply reader drops a ``null`` optional query argument,
``NULL_OPTIONAL_ARGUMENT``; ``early_diagnosis: null`` is the contract's own "absent");
the grammar dialects cap string lengths and write a string enum holding a character the
converter mis-copies as a plain string. A reply the sent schema admits can so still be
rejected by validation, with a reason the next turn carries back.
"""

from __future__ import annotations

import copy
from typing import Any

#: Canonical dialect of each accepted ``structured_output`` name.
DIALECT_ALIASES = {
    "openai": "openai", "json_schema": "openai",
    "llama_cpp": "llama_cpp", "json_object_schema": "llama_cpp",
    "ollama": "ollama", "vllm": "vllm", "sglang": "sglang",
    "json_object": "json_object", "none": "none",
}
#: Default ``maxLength`` cap of the grammar dialects: llama.cpp's grammar parser refuses
#: longer bounded repetitions of a string's character rule ("exceeds sane defaults").
GRAMMAR_MAX_STRING_CHARS = 1000
#: Largest integer range written out as an enum by :func:`grammar_friendly`.
GRAMMAR_MAX_ENUM_RANGE = 1000
#: OpenAI's limits on enums in a strict schema ("Supported schemas", "Objects have
#: limitations on nesting depth and size"): values in all enums, and the total length of
#: one string enum's values once it has more than :data:`OPENAI_LONG_ENUM_VALUES`.
OPENAI_MAX_ENUM_VALUES = 1000
OPENAI_LONG_ENUM_VALUES = 250
OPENAI_MAX_LONG_ENUM_CHARS = 7500
#: Keywords OpenAI's strict mode accepts (structured outputs, "Supported schemas").
OPENAI_STRICT_KEYWORDS = frozenset({
    "type", "properties", "required", "additionalProperties", "items", "enum", "const",
    "anyOf", "description", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
    "multipleOf", "minItems", "maxItems", "pattern", "format", "$defs", "$ref",
})


def canonical_dialect(name: str) -> str:
    """The canonical dialect of a ``structured_output`` value.

    Raises:
        ValueError: an unknown name.
    """
    try:
        return DIALECT_ALIASES[name]
    except KeyError:
        raise ValueError(f"unknown structured_output {name!r}; use one of "
                         f"{sorted(DIALECT_ALIASES)}") from None


def response_format(dialect: str, schema: dict[str, Any], name: str,
                    max_string_chars: int | None = None) -> dict[str, Any] | None:
    """The ``response_format`` value of a chat-completions body, or ``None`` (not sent).

    Args:
        dialect: a ``structured_output`` name (aliases accepted).
        schema: the per-turn reply schema.
        name: the schema name (``[A-Za-z0-9_-]``, at most 64 characters).
        max_string_chars: cap on every ``maxLength`` (default: the dialect's own).
    """
    dialect = canonical_dialect(dialect)
    if dialect == "none":
        return None
    if dialect == "json_object":
        return {"type": "json_object"}
    if dialect == "openai":
        return {"type": "json_schema",
                "json_schema": {"name": name, "schema": openai_strict(schema), "strict": True}}
    if dialect == "llama_cpp":
        return {"type": "json_object", "schema": grammar_friendly(
            schema, max_string_chars or GRAMMAR_MAX_STRING_CHARS)}
    if dialect == "ollama":
        return {"type": "json_schema", "json_schema": {"name": name, "schema": grammar_friendly(
            schema, max_string_chars or GRAMMAR_MAX_STRING_CHARS)}}
    sent = cap_strings(schema, max_string_chars) if max_string_chars else schema
    return {"type": "json_schema", "json_schema": {"name": name, "schema": sent}}


# -- transforms ----------------------------------------------------------------------------


_JSON_SCALARS = (str, int, float, bool, type(None))


def _copy(value: Any) -> Any:
    """A deep copy of a JSON value (``copy.deepcopy`` for anything else): the schema's
    leaves are JSON, and deepcopy's memo bookkeeping cost more than the whole walk."""
    kind = type(value)
    if kind is dict:
        return {k: _copy(v) for k, v in value.items()}
    if kind is list:
        return [_copy(v) for v in value]
    if kind in _JSON_SCALARS:
        return value
    return copy.deepcopy(value)


def _walk(schema: Any, fn: Any, keep: frozenset[str] | None = None) -> Any:
    """Apply ``fn`` bottom-up to every sub-schema (dicts under the schema keywords).

    ``keep``: the only keywords the copies hold (others are neither copied nor walked).
    """
    if isinstance(schema, list):
        return [_walk(s, fn, keep) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if keep is not None and key not in keep:
            continue
        if key == "properties" and isinstance(value, dict):
            out[key] = {k: _walk(v, fn, keep) for k, v in value.items()}
        elif key in ("items", "additionalProperties") and isinstance(value, dict):
            out[key] = _walk(value, fn, keep)
        elif key in ("anyOf", "oneOf", "allOf", "prefixItems") and isinstance(value, list):
            out[key] = [_walk(v, fn, keep) for v in value]
        elif key == "$defs" and isinstance(value, dict):
            out[key] = {k: _walk(v, fn, keep) for k, v in value.items()}
        else:
            out[key] = _copy(value)
    return fn(out)


def _capped(node: dict[str, Any], max_chars: int) -> dict[str, Any]:
    """``node`` (a copy, changed in place) with its string length capped at ``max_chars``."""
    if node.get("type") == "string" and "enum" not in node and "const" not in node:
        node["maxLength"] = min(int(node.get("maxLength", max_chars)), max_chars)
        if "minLength" in node:
            node["minLength"] = min(int(node["minLength"]), node["maxLength"])
    return node


def cap_strings(schema: dict[str, Any], max_chars: int) -> dict[str, Any]:
    """Every ``maxLength`` at most ``max_chars``, one set on every unbounded string."""
    result: dict[str, Any] = _walk(schema, lambda node: _capped(node, max_chars))
    return result


def _grammar_safe(value: Any) -> bool:
    """Whether a converter that copies a JSON string literal into GBNF writes it right:
    llama-cpp-python's does not escape a backslash it copies, so a quote, a backslash or a
    control character in an enum value gives a grammar llama.cpp refuses (and a server
    that dies on it)."""
    return not isinstance(value, str) or not any(
        ch in '"\\' or ord(ch) < 0x20 or 0x7F <= ord(ch) <= 0x9F for ch in value)


def grammar_friendly(schema: dict[str, Any], max_chars: int) -> dict[str, Any]:
    """The llama.cpp-converter form: strings capped at ``max_chars``; an integer with both
    ``minimum`` and ``maximum`` spanning at most :data:`GRAMMAR_MAX_ENUM_RANGE` values
    becomes an ``enum`` (llama-cpp-python's converter ignores the bounds); a string enum
    holding a value the converter cannot copy safely (:func:`_grammar_safe`, e.g. a table
    name with a quote in a hostile snapshot) becomes a plain string of that length (the
    validator still checks the name)."""
    def per_node(node: dict[str, Any]) -> dict[str, Any]:
        # One walk: each node is capped (as :func:`cap_strings`), then rewritten.
        node = _capped(node, max_chars)
        values = node.get("enum")
        if isinstance(values, list) and not all(_grammar_safe(v) for v in values):
            longest = max(len(v) for v in values if isinstance(v, str))
            return {k: v for k, v in node.items() if k != "enum"} | {
                "type": "string", "minLength": 1, "maxLength": min(longest, max_chars)}
        if node.get("type") == "integer" and "minimum" in node and "maximum" in node:
            low, high = int(node["minimum"]), int(node["maximum"])
            if 0 <= high - low < GRAMMAR_MAX_ENUM_RANGE:
                rest = {k: v for k, v in node.items() if k not in ("minimum", "maximum")}
                rest["enum"] = list(range(low, high + 1))
                return rest
        return node

    result: dict[str, Any] = _walk(schema, per_node)
    return result


def _merge_roots(schema: dict[str, Any]) -> dict[str, Any]:
    """One object from a root ``anyOf`` of objects with the same keys: each property an
    ``anyOf`` of the variants' schemas (duplicates dropped, order kept)."""
    variants = schema.get("anyOf")
    if not isinstance(variants, list):
        return schema
    keys = list(variants[0]["properties"])
    merged: dict[str, Any] = {"type": "object", "properties": {}, "required": keys,
                              "additionalProperties": False}
    for key in keys:
        options: list[Any] = []
        for variant in variants:
            sub = variant["properties"][key]
            for option in sub["anyOf"] if set(sub) == {"anyOf"} else [sub]:
                if option not in options:
                    options.append(option)
        merged["properties"][key] = options[0] if len(options) == 1 else {"anyOf": options}
    return merged


def openai_strict(schema: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's strict subset: an object root (a root ``anyOf`` merged, see
    :func:`_merge_roots`: the reject-after-support coupling is then the validator's
    alone), every object with ``additionalProperties: false`` and every property
    required, a property that was optional made nullable (``anyOf [X, {"type": "null"}]``),
    and only :data:`OPENAI_STRICT_KEYWORDS`."""
    enums: list[dict[str, Any]] = []  # the nodes with an enum, as _walk visits them

    def strict(node: dict[str, Any]) -> dict[str, Any]:
        # ``node`` is a new dict of the strict keywords only (``_walk``'s ``keep``).
        if node.get("type") == "object":
            dropped = node.get("additionalProperties")
            if isinstance(dropped, dict):  # replaced below: its enums leave the schema
                gone = _dict_ids(dropped)
                enums[:] = [n for n in enums if id(n) not in gone]
            properties = node.get("properties", {})
            required = set(node.get("required", []))
            for key, prop in properties.items():
                if key not in required:
                    properties[key] = {"anyOf": [prop, {"type": "null"}]}
            node["properties"] = properties
            node["required"] = list(properties)
            node["additionalProperties"] = False
        if isinstance(node.get("enum"), list):
            enums.append(node)
        return node

    walked = _walk(_merge_roots(schema), strict, OPENAI_STRICT_KEYWORDS)
    result: dict[str, Any] = _fit_openai_enums(walked, enums)
    return result


def _dict_ids(value: Any) -> set[int]:
    """The ids of every dict in a JSON value, ``value`` itself included."""
    found: set[int] = set()
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            found.add(id(item))
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return found


def _fit_openai_enums(schema: dict[str, Any], nodes: list[dict[str, Any]]) -> dict[str, Any]:
    """Widen enums until the schema is within OpenAI's enum limits: a string enum of more
    than :data:`OPENAI_LONG_ENUM_VALUES` values longer than
    :data:`OPENAI_MAX_LONG_ENUM_CHARS` in total becomes a plain string, then the largest
    enums become plain strings (or integer ranges) until all hold at most
    :data:`OPENAI_MAX_ENUM_VALUES` values. The validator still checks every value (a
    snapshot with thousands of tables, a hypothesis with many questions).

    ``nodes``: the schema's nodes holding an enum, children before their parent and in
    key order (the order :func:`_walk` visits them)."""
    def widen(node: dict[str, Any]) -> None:
        values = node.pop("enum")
        if values and all(type(v) is int for v in values):
            node.update(type="integer", minimum=min(values), maximum=max(values))
        else:
            node["type"] = "string"

    for node in nodes:
        values = node["enum"]
        if len(values) > OPENAI_LONG_ENUM_VALUES and sum(
                len(v) for v in values if isinstance(v, str)) > OPENAI_MAX_LONG_ENUM_CHARS:
            widen(node)
    nodes = sorted((n for n in nodes if "enum" in n), key=lambda n: -len(n["enum"]))
    total = sum(len(n["enum"]) for n in nodes)
    for node in nodes:
        if total <= OPENAI_MAX_ENUM_VALUES:
            break
        total -= len(node["enum"])
        widen(node)
    return schema
