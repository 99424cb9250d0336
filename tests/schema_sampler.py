"""Draw random instances of a reply schema (the subset ``loop.reply_schema`` writes).

A tiny generator for tests: it walks the schema and picks an ``anyOf`` branch, an enum
value, an array length within ``minItems``..``maxItems``, an integer within its bounds
and a string from a pool that suits the property (an existing path, a read-only SELECT, a
distinct question), so that every rule the schema cannot state holds too and the engine's
validator is expected to accept every instance.
"""

from __future__ import annotations

import random
from typing import Any

#: Strings by property name; anything else gets a short sentence.
POOLS: dict[str, list[str]] = {
    "path": ["shop/pricing.py"],
    "sql": ["SELECT id, total FROM orders", "SELECT count(*) FROM orders"],
    "pattern": ["discount", "percent", "total"],
    "symbol": ["apply_discount", "order_total"],
    "prefix": ["shop/", ""],
    "path_glob": ["*.py", "shop/*.py"],
    "table": ["orders"],
}


def sample(schema: dict[str, Any], rng: random.Random, name: str = "",
           counter: list[int] | None = None) -> Any:
    """One instance of ``schema`` (see the module docstring)."""
    counter = counter if counter is not None else [0]
    if "anyOf" in schema:
        return sample(rng.choice(schema["anyOf"]), rng, name, counter)
    if "enum" in schema:
        return rng.choice(schema["enum"])
    kind = schema.get("type")
    if kind == "null":
        return None
    if kind == "object":
        out = {}
        for key, prop in schema.get("properties", {}).items():
            if key in schema.get("required", []) or rng.random() < 0.5:
                out[key] = sample(prop, rng, key, counter)
        if name == "arguments" and "start_line" in out:
            out["start_line"], out["end_line"] = 1, rng.randint(1, 5)
        return out
    if kind == "array":
        if name == "params":  # the pool's statements have no placeholders
            return []
        low = schema.get("minItems", 0)
        high = min(schema.get("maxItems", 3), low + 3)
        items = schema.get("items", {"type": "string"})
        values: list[Any] = []
        for _ in range(rng.randint(low, high)):
            value = sample(items, rng, name, counter)
            if value not in values:  # ids cited twice are allowed, but keep it plain
                values.append(value)
        return values
    if kind == "integer":
        low = schema.get("minimum", 0)
        high = schema.get("maximum", low + 50)
        return rng.randint(low, high)
    if kind == "boolean":
        return rng.random() < 0.5
    if kind == "string":
        if name in POOLS:
            return rng.choice(POOLS[name])
        counter[0] += 1
        text = f"text {counter[0]} for {name or 'value'}"
        return text[: schema.get("maxLength", len(text))]
    raise AssertionError(f"sampler does not know {schema!r}")
