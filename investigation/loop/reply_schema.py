"""The per-turn reply schema: the reply contract of one turn, made visible to the decoder.

:func:`turn_schema` builds a JSON Schema from the frozen context of a step (and from
nothing else), so the same context always gives the same schema. It is stored and hashed
next to the context (``analysis/investigation/NNNN/reply-schema.json``) and sent to the
provider, where a dialect (:mod:`investigation.llm.dialects`) turns it into what that
server compiles. The validator (:mod:`investigation.loop.validation`) stays the
authority: every reply the schema admits is meant to pass it, and the schema never
admits a shape the contract refuses. Where a rule cannot be written in the subset every
server compiles (distinct question texts, ``end_line >= start_line``, SQL that compiles,
a refund that depends on the score), the validator alone checks it.

How the schema follows the context (``docs/reply-contract.md`` has the same table):

=====================  ===================================================================
reply part             what this turn's schema admits
=====================  ===================================================================
``assessment``         ``null`` when ``previous_result`` is null (a first turn or nothing
                       pending); otherwise a required object whose ``evidence_ids`` is
                       exactly ``[<previous result id>]`` and ``score`` an integer 0..100
``update.confidence``  every label; ``supported``/``strongly_supported`` only with
                       ``evidence_ids`` drawn from evidence that has findings, and only
                       when the context holds such evidence
``update.evidence_ids``enum of the evidence ids in the context (``[]`` when none)
``resolve_questions``  enum of this hypothesis's open question ids, non-empty only
                       together with non-empty ``evidence_ids`` (``[]`` when none)
``new_questions``      at most ``min(10, max_questions - own questions)`` texts; none
                       on a closing turn (it ends the hypothesis)
``next``               only the context's ``allowed_actions``
``query``              an ``anyOf`` over the operations this turn can afford, each
                       ``{"action": "query", "operation": <that operation>, "arguments":
                       <its argument schema from the context>}``; database operations
                       only when a database is packed, ``logs.search`` only with logs
``test``               only when allowed (a test cost is configured and a feedback key
                       is present: the context's ``allowed_actions`` says so), with the
                       affordable kinds
``finish``             ``early_diagnosis`` only when the policy enables it and active,
                       undeferred alternatives exist (enum of their ids)
``reject``             never together with a ``supported``/``strongly_supported`` update
                       (the root is then an ``anyOf`` of two reply shapes)
=====================  ===================================================================

Affordable means: the operation's cost fits the balance with no refund; when nothing
does, the operations that the largest refund the pending result could earn would make
affordable (the validator then needs a score high enough; the prompt header says so).
"""

from __future__ import annotations

import json
from typing import Any

from investigation import jsonio
from investigation.budget import rules
from investigation.constants import OPERATIONS
from investigation.loop.contract import (
    MAX_CITED_IDS,
    MAX_NEW_QUESTIONS,
    MAX_QUESTION_CHARS,
    MAX_TEXT_CHARS,
    MAX_TITLE_CHARS,
)

#: Version of the schema builder; stored with every schema (``schema_version``).
TURN_SCHEMA_VERSION = "turn-schema-v1"
#: Confidence labels in the contract's order; the last two need findings.
CONFIDENCE_LABELS = ("unassessed", "weak", "plausible", "supported", "strongly_supported",
                     "weakened")
SUPPORT_LABELS = ("supported", "strongly_supported")
#: Longest table name ``db.schema`` takes (``DbSchemaArgs.table``).
MAX_TABLE_NAME_CHARS = 1000
#: Operations that read a packed database / the packed logs.
DB_OPERATIONS = ("db.tables", "db.schema", "db.query")
LOG_OPERATIONS = ("logs.search",)


def _text(max_chars: int, min_chars: int = 1) -> dict[str, Any]:
    return {"type": "string", "minLength": min_chars, "maxLength": max_chars}


def _ids(ids: list[str], *, min_items: int = 0, max_items: int = MAX_CITED_IDS
         ) -> dict[str, Any]:
    """An array of ids drawn from ``ids`` (an empty array when there are none)."""
    if not ids:
        return {"type": "array", "items": {"type": "string"}, "maxItems": 0}
    schema: dict[str, Any] = {"type": "array", "items": {"type": "string", "enum": ids},
                              "maxItems": max_items}
    if min_items:
        schema["minItems"] = min_items
    return schema


def _object(properties: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    return {"type": "object", "properties": properties,
            "required": list(properties) if required is None else required,
            "additionalProperties": False}


def _assessment(context: dict[str, Any]) -> dict[str, Any]:
    previous = context.get("previous_result")
    if previous is None:
        return {"type": "null"}
    return _object({
        "score": {"type": "integer", "minimum": 0, "maximum": 100},
        "reason": _text(MAX_TEXT_CHARS),
        "evidence_ids": _ids([str(previous["evidence_id"])], min_items=1, max_items=1),
    })


def _update_variants(context: dict[str, Any], max_questions: int) -> tuple[
        list[dict[str, Any]], list[dict[str, Any]]]:
    """``(plain, supported)``: update shapes without and with a support label."""
    hid = int(context["hypothesis"]["id"])
    evidence = [str(e["evidence_id"]) for e in context["evidence"]]
    with_findings = [str(e["evidence_id"]) for e in context["evidence"]
                     if int(e["item_count"]) > 0]
    own = [q for q in context["questions"] if int(q["hypothesis_id"]) == hid]
    open_ids = [str(q["question_id"]) for q in own if q["status"] == "open"]
    room = max(0, min(MAX_NEW_QUESTIONS, max_questions - len(own)))
    if context.get("closing_reason"):
        room = 0  # a closing turn ends the hypothesis: a new question would never be worked
    new_questions = {"type": "array", "items": _text(MAX_QUESTION_CHARS), "maxItems": room}
    note = _text(MAX_TEXT_CHARS, min_chars=0)
    plain_labels = [c for c in CONFIDENCE_LABELS if c not in SUPPORT_LABELS]

    def update(labels: list[str], cited: dict[str, Any], resolve: dict[str, Any]
               ) -> dict[str, Any]:
        return _object({"confidence": {"type": "string", "enum": labels},
                        "evidence_ids": cited, "resolve_questions": resolve,
                        "new_questions": new_questions, "note": note})

    no_resolution = _ids([])
    plain = [update(plain_labels, _ids(evidence), no_resolution)]
    if open_ids and evidence:
        plain.append(update(plain_labels, _ids(evidence, min_items=1), _ids(open_ids,
                                                                               min_items=1)))
    supported = []
    if with_findings:
        supported.append(update(list(SUPPORT_LABELS), _ids(with_findings, min_items=1),
                                _ids(open_ids)))
    return plain, supported


def affordable_operations(context: dict[str, Any]) -> list[str]:
    """The operations this turn's schema offers, in :data:`OPERATIONS` order.

    An operation is offered when the snapshot has what it reads and its configured cost
    fits the balance with no refund; when none fits, those that fit the balance after
    the largest refund the pending result could earn (score 100).
    """
    snapshot = context["case"]["snapshot"]
    costs: dict[str, int] = context["budget"]["costs_units"]
    described = {op["operation"] for op in context["operations"]}
    usable = [op for op in OPERATIONS if op in described and op in costs
              and not (op in DB_OPERATIONS and not snapshot.get("databases"))
              and not (op in LOG_OPERATIONS and not snapshot.get("log_files"))]
    balance = int(context["hypothesis"]["balance_units"])
    now = [op for op in usable if costs[op] <= balance]
    if now:
        return now
    best = balance + _best_refund(context)
    return [op for op in usable if costs[op] <= best]


def _best_refund(context: dict[str, Any]) -> int:
    previous = context.get("previous_result")
    if previous is None:
        return 0
    return rules.refund_units(int(previous["cost_units"]), 100,
                              int(previous["novelty_permille"]),
                              int(context["budget"]["max_refund_percent"]))


def affordable_test_kinds(context: dict[str, Any]) -> list[str]:
    """Test kinds with a configured cost that the balance (plus the best refund) covers."""
    costs: dict[str, int] = context["budget"].get("test_costs_units", {})
    best = int(context["hypothesis"]["balance_units"]) + _best_refund(context)
    return [kind for kind in ("human", "automated") if kind in costs and costs[kind] <= best]


#: Every operation's argument schema in turn-schema form by the ``repr`` of the
#: context's operations (JSON data: equal values have equal reprs), as JSON text.
_OPERATION_SCHEMAS: dict[str, str] = {}


def _operation_schemas(operations: list[dict[str, Any]]) -> str:
    """``{operation: argument_schema(...)}`` of a context's operations, as JSON text."""
    key = repr(operations)
    text = _OPERATION_SCHEMAS.get(key)
    if text is None:
        text = json.dumps({op["operation"]: argument_schema(op["arguments_schema"])
                           for op in operations}, ensure_ascii=False)
        if len(_OPERATION_SCHEMAS) >= _ARGUMENT_SCHEMAS_KEPT:
            _OPERATION_SCHEMAS.clear()
        _OPERATION_SCHEMAS[key] = text
    return text


def _query_variants(context: dict[str, Any], operations: str) -> list[dict[str, Any]]:
    schemas: dict[str, dict[str, Any]] = jsonio.loads(operations)  # a fresh copy to change
    # Names db.schema takes (the validator refuses a longer one).
    tables = [t for t in context["case"]["snapshot"].get("tables") or []
              if 0 < len(t) <= MAX_TABLE_NAME_CHARS]
    if tables and "db.schema" in schemas:
        schemas["db.schema"]["properties"]["table"] = {"type": "string", "enum": tables}
    return [_object({"action": {"type": "string", "enum": ["query"]},
                     "operation": {"type": "string", "enum": [op]},
                     "arguments": schemas[op]})
            for op in affordable_operations(context)]


def _json_copy(value: Any) -> Any:
    """A deep copy of JSON data (dicts, lists, scalars): what ``copy.deepcopy`` returns for
    it, without its memo."""
    if isinstance(value, dict):
        return {k: _json_copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_copy(v) for v in value]
    return value


#: :func:`argument_schema` results by the JSON text of their input (a pure function of
#: it): the same few operation schemas come with every turn's context. Kept as JSON text,
#: so every caller gets a fresh object to change.
_ARGUMENT_SCHEMAS: dict[str, str] = {}
_ARGUMENT_SCHEMAS_KEPT = 256


def argument_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """An operation's argument schema in the form the turn schema uses.

    From the pydantic JSON Schema the context carries: titles and defaults dropped,
    ``anyOf [X, null]`` of an optional argument written as ``X`` (an optional argument is
    left out, not sent as null), ``additionalProperties: false`` and ``required`` kept.
    """
    try:
        key = json.dumps(schema, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError):  # not JSON text: no cache
        return _argument_schema(schema)
    text = _ARGUMENT_SCHEMAS.get(key)
    if text is None:
        text = json.dumps(_argument_schema(schema), ensure_ascii=False)
        if len(_ARGUMENT_SCHEMAS) >= _ARGUMENT_SCHEMAS_KEPT:
            _ARGUMENT_SCHEMAS.clear()  # a bound, not an LRU: single dict operations only
        _ARGUMENT_SCHEMAS[key] = text
    result: dict[str, Any] = jsonio.loads(text)
    return result


def _argument_schema(schema: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "object", "properties": {},
                           "required": list(schema.get("required", [])),
                           "additionalProperties": False}
    for name, prop in schema.get("properties", {}).items():
        prop = _json_copy(prop)
        prop.pop("title", None)
        prop.pop("default", None)
        variants = prop.get("anyOf")
        if isinstance(variants, list):
            kept = [v for v in variants if v.get("type") != "null"]
            if len(kept) == 1 and len(kept) < len(variants):
                merged = {k: v for k, v in prop.items() if k != "anyOf"}
                merged.update(kept[0])
                prop = merged
        out["properties"][name] = prop
    return out


def _next_variants(context: dict[str, Any], *, allow_reject: bool,
                   operations: str) -> list[dict[str, Any]]:
    allowed = context["allowed_actions"]
    variants: list[dict[str, Any]] = []
    if "query" in allowed:
        variants.extend(_query_variants(context, operations))
    kinds = affordable_test_kinds(context)
    if "test" in allowed and kinds:
        variants.append(_object({
            "action": {"type": "string", "enum": ["test"]},
            "test": _object({"kind": {"type": "string", "enum": kinds},
                             "title": _text(MAX_TITLE_CHARS),
                             "instructions": _text(MAX_TEXT_CHARS),
                             "expected_observation": _text(MAX_TEXT_CHARS)})}))
    if "finish" in allowed:
        finish: dict[str, Any] = {"action": {"type": "string", "enum": ["finish"]},
                                  "reason": _text(MAX_TEXT_CHARS)}
        alternatives = early_diagnosis_candidates(context)
        if alternatives:
            finish["early_diagnosis"] = _object({
                "defer_alternatives": {"type": "array",
                                       "items": {"type": "integer", "enum": alternatives},
                                       "minItems": 1, "maxItems": len(alternatives)},
                "rationale": _text(MAX_TEXT_CHARS)})
        variants.append(_object(finish, required=["action", "reason"]))
    if "reject" in allowed and allow_reject:
        variants.append(_object({"action": {"type": "string", "enum": ["reject"]},
                                 "reason": _text(MAX_TEXT_CHARS)}))
    return variants


def early_diagnosis_candidates(context: dict[str, Any]) -> list[int]:
    """Alternatives a ``finish`` may name for deferral: none when the policy disables
    early diagnosis or this hypothesis is itself assessment-only; else every other
    active hypothesis not yet deferred (``loop.early_diagnosis`` structural rules)."""
    if not context.get("early_diagnosis", {}).get("enabled"):
        return []
    if context["hypothesis"].get("deferred_by") is not None:
        return []
    return [int(o["id"]) for o in context["other_hypotheses"]
            if o["status"] == rules.ACTIVE and o.get("deferred_by") is None]


def _one_of(variants: list[dict[str, Any]]) -> dict[str, Any]:
    return variants[0] if len(variants) == 1 else {"anyOf": variants}


def turn_schema(context: dict[str, Any], max_questions: int) -> dict[str, Any]:
    """The reply schema of one turn (see the module docstring for every rule).

    Args:
        context: the stored (fitted) context document of the step.
        max_questions: the frozen ``loop.max_questions_per_hypothesis``.

    Returns:
        A JSON Schema (draft 2020-12 subset: ``type``, ``properties``, ``required``,
        ``additionalProperties``, ``enum``, ``anyOf``, ``items``, ``minItems``,
        ``maxItems``, ``minLength``, ``maxLength``, ``minimum``, ``maximum``,
        ``description``). Its root is an object, or an ``anyOf`` of two objects when a
        supported update must not be combined with ``reject``.
    """
    assessment = _assessment(context)
    plain, supported = _update_variants(context, max_questions)
    operations = _operation_schemas(context["operations"])
    every_next = _next_variants(context, allow_reject=True, operations=operations)
    shapes = [(plain, every_next)]
    if supported:
        no_reject = _next_variants(context, allow_reject=False, operations=operations)
        if len(no_reject) == len(every_next):  # reject is not allowed anyway
            shapes = [(plain + supported, every_next)]
        elif no_reject:
            shapes.append((supported, no_reject))
    roots = [_object({"assessment": assessment, "update": _one_of(updates),
                      "next": _one_of(nexts)}) for updates, nexts in shapes]
    return _one_of(roots)
