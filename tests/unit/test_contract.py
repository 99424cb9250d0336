"""The reply contract: ``parse_reply`` accepts exactly one strict JSON reply object and
refuses everything else with a stable code (seed 000, "Model/controller contract")."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from investigation.loop import contract
from investigation.loop.contract import (
    FinishAction,
    QueryAction,
    RejectAction,
    Reply,
    ReplyRejected,
    parse_reply,
    reply_json_schema,
)


def reply(**overrides: Any) -> dict[str, Any]:
    """A valid reply document (an assessed query); ``overrides`` replace top-level keys."""
    doc: dict[str, Any] = {
        "assessment": {"score": 80, "reason": "the search found the divisor",
                       "evidence_ids": ["E1"]},
        "update": {"confidence": "plausible", "evidence_ids": ["E1"], "resolve_questions": [],
                   "new_questions": ["Who calls apply_discount?"], "note": "looks like /10"},
        "next": {"action": "query", "operation": "source.read",
                 "arguments": {"path": "shop/pricing.py", "start_line": 1, "end_line": 3}},
    }
    doc.update(overrides)
    return doc


def code_of(text: str) -> str:
    with pytest.raises(ReplyRejected) as info:
        parse_reply(text)
    assert info.value.detail  # a rejection always says why
    return info.value.code


def with_path(path: tuple[str, ...], value: Any) -> str:
    """The valid reply with one nested value replaced, as JSON text."""
    doc = reply()
    target = doc
    for part in path[:-1]:
        target = target[part]
    target[path[-1]] = value
    return json.dumps(doc)


def without(path: tuple[str, ...]) -> str:
    doc = reply()
    target = doc
    for part in path[:-1]:
        target = target[part]
    del target[path[-1]]
    return json.dumps(doc)


# -- accepted replies --------------------------------------------------------------------


def test_valid_query_reply_parses_into_the_typed_models() -> None:
    parsed = parse_reply(json.dumps(reply()))
    assert isinstance(parsed, Reply)
    assert parsed.assessment is not None
    assert parsed.assessment.score == 80
    assert parsed.assessment.evidence_ids == ["E1"]
    assert parsed.update.confidence == "plausible"
    assert parsed.update.new_questions == ["Who calls apply_discount?"]
    assert isinstance(parsed.next, QueryAction)
    assert parsed.next.operation == "source.read"
    assert parsed.next.arguments == {"path": "shop/pricing.py", "start_line": 1, "end_line": 3}


@pytest.mark.parametrize(("nxt", "model"), [
    ({"action": "finish", "reason": "enough evidence"}, FinishAction),
    ({"action": "reject", "reason": "contradicted by E2"}, RejectAction),
    ({"action": "test", "test": {"kind": "human", "title": "Order with 10%",
                                 "instructions": "Place an order of 100 with 10% off",
                                 "expected_observation": "total is 90"}}, contract.TestAction),
])
def test_every_next_action_kind_is_discriminated(nxt: dict[str, Any], model: type) -> None:
    parsed = parse_reply(json.dumps(reply(assessment=None, next=nxt)))
    assert parsed.assessment is None
    assert isinstance(parsed.next, model)
    assert parsed.next.action == nxt["action"]


def test_surrounding_whitespace_is_tolerated() -> None:
    assert parse_reply("\n  " + json.dumps(reply()) + "\n\t ").update.note == "looks like /10"


def test_score_bounds_are_inclusive() -> None:
    assert parse_reply(with_path(("assessment", "score"), 0)).assessment.score == 0  # type: ignore[union-attr]
    assert parse_reply(with_path(("assessment", "score"), 100)).assessment.score == 100  # type: ignore[union-attr]


# -- REPLY_NOT_JSON ----------------------------------------------------------------------


@pytest.mark.parametrize("text", [
    "",
    "I think the bug is in apply_discount.",
    "```json\n" + json.dumps(reply()) + "\n```",
    json.dumps(reply()) + "\nHope this helps!",
    json.dumps(reply()) + json.dumps(reply()),
    "{'assessment': null}",
    "[" * 100_000,
], ids=["empty", "prose", "fenced", "trailing-text", "two-objects", "python-dict", "deep"])
def test_non_json_text_is_reply_not_json(text: str) -> None:
    assert code_of(text) == "REPLY_NOT_JSON"


@pytest.mark.parametrize("text", [
    "[" + json.dumps(reply()) + "]", '"a string"', "42", "null", "true",
], ids=["array", "string", "number", "null", "bool"])
def test_json_that_is_not_an_object_is_reply_not_json(text: str) -> None:
    assert code_of(text) == "REPLY_NOT_JSON"


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_non_standard_constants_are_reply_not_json(constant: str) -> None:
    text = json.dumps(reply()).replace('"score": 80', f'"score": {constant}')
    assert constant in text
    assert code_of(text) == "REPLY_NOT_JSON"


# -- REPLY_DUPLICATE_KEYS ----------------------------------------------------------------


def test_duplicate_top_level_key_is_refused() -> None:
    text = json.dumps(reply())[:-1] + ', "next": {"action": "finish", "reason": "x"}}'
    assert code_of(text) == "REPLY_DUPLICATE_KEYS"


def test_duplicate_key_in_nested_arguments_is_refused() -> None:
    text = json.dumps(reply()).replace('"start_line": 1', '"start_line": 1, "start_line": 2')
    assert text.count('"start_line"') == 2
    assert code_of(text) == "REPLY_DUPLICATE_KEYS"


def test_duplicate_keys_win_over_schema_errors() -> None:
    # Duplicate keys are refused while parsing, before any schema check.
    assert code_of('{"assessment": null, "assessment": null}') == "REPLY_DUPLICATE_KEYS"


# -- REPLY_SCHEMA_INVALID ----------------------------------------------------------------


@pytest.mark.parametrize("key", ["assessment", "update", "next"])
def test_missing_top_level_key_is_schema_invalid(key: str) -> None:
    assert code_of(without((key,))) == "REPLY_SCHEMA_INVALID"


@pytest.mark.parametrize("path", [
    ("update", "confidence"), ("update", "evidence_ids"), ("update", "resolve_questions"),
    ("update", "new_questions"), ("update", "note"), ("assessment", "score"),
    ("assessment", "reason"), ("assessment", "evidence_ids"), ("next", "operation"),
    ("next", "arguments"), ("next", "action"),
])
def test_missing_nested_key_is_schema_invalid(path: tuple[str, ...]) -> None:
    assert code_of(without(path)) == "REPLY_SCHEMA_INVALID"


@pytest.mark.parametrize("path", [
    ("extra",), ("update", "balance_units"), ("update", "question_ids"),
    ("assessment", "refund_units"), ("next", "cost_units"), ("next", "deadline"),
])
def test_extra_keys_are_schema_invalid(path: tuple[str, ...]) -> None:
    # Controller-owned facts (costs, refunds, balances, ids, deadlines) cannot be supplied.
    assert code_of(with_path(path, 0)) == "REPLY_SCHEMA_INVALID"


@pytest.mark.parametrize("score", ["80", 101, -1, True, False, 80.0, 80.5, None, [80]],
                         ids=repr)
def test_score_must_be_a_strict_integer_in_range(score: Any) -> None:
    assert code_of(with_path(("assessment", "score"), score)) == "REPLY_SCHEMA_INVALID"


@pytest.mark.parametrize(("path", "value"), [
    (("update", "evidence_ids"), "E1"),
    (("update", "evidence_ids"), [1]),
    (("update", "resolve_questions"), [None]),
    (("update", "new_questions"), "one question"),
    (("update", "note"), None),
    (("update", "confidence"), 3),
    (("assessment", "reason"), ""),
    (("assessment", "evidence_ids"), []),
    (("assessment",), "none"),
    (("next", "arguments"), ["path"]),
    (("next", "operation"), ""),
    (("next",), "finish"),
], ids=repr)
def test_wrong_types_are_schema_invalid(path: tuple[str, ...], value: Any) -> None:
    assert code_of(with_path(path, value)) == "REPLY_SCHEMA_INVALID"


@pytest.mark.parametrize("action", ["explode", "Query", "hypothesis.create", ""])
def test_unknown_action_is_schema_invalid(action: str) -> None:
    text = json.dumps(reply(next={"action": action, "reason": "x"}))
    assert code_of(text) == "REPLY_SCHEMA_INVALID"


@pytest.mark.parametrize("confidence", ["certain", "Supported", "strong", "", "rejected"])
def test_unknown_confidence_is_schema_invalid(confidence: str) -> None:
    assert code_of(with_path(("update", "confidence"), confidence)) == "REPLY_SCHEMA_INVALID"


@pytest.mark.parametrize("confidence", ["unassessed", "weak", "plausible", "supported",
                                        "strongly_supported", "weakened"])
def test_every_documented_confidence_is_accepted(confidence: str) -> None:
    assert parse_reply(with_path(("update", "confidence"),
                                 confidence)).update.confidence == confidence


def test_test_descriptor_kind_is_closed() -> None:
    nxt = {"action": "test", "test": {"kind": "robot", "title": "t", "instructions": "i",
                                      "expected_observation": "o"}}
    assert code_of(json.dumps(reply(assessment=None, next=nxt))) == "REPLY_SCHEMA_INVALID"


def test_finish_needs_a_reason_and_takes_no_query_fields() -> None:
    assert code_of(json.dumps(reply(next={"action": "finish"}))) == "REPLY_SCHEMA_INVALID"
    mixed = {"action": "finish", "reason": "x", "operation": "db.tables", "arguments": {}}
    assert code_of(json.dumps(reply(next=mixed))) == "REPLY_SCHEMA_INVALID"


def test_too_many_new_questions_are_schema_invalid() -> None:
    doc = reply()
    doc["update"]["new_questions"] = [f"question {i}?" for i in range(11)]
    assert code_of(json.dumps(doc)) == "REPLY_SCHEMA_INVALID"
    doc["update"]["new_questions"] = doc["update"]["new_questions"][:10]
    assert len(parse_reply(json.dumps(doc)).update.new_questions) == 10


def test_schema_detail_names_the_failing_field() -> None:
    with pytest.raises(ReplyRejected) as info:
        parse_reply(with_path(("assessment", "score"), 101))
    assert info.value.code == "REPLY_SCHEMA_INVALID"
    assert "assessment.score" in info.value.detail


def test_rejection_detail_is_bounded() -> None:
    rej = ReplyRejected("X", "y" * 5000)
    assert rej.code == "X"
    assert len(rej.detail) == 500


def test_reply_json_schema_is_closed_and_requires_the_three_keys() -> None:
    schema = reply_json_schema()
    assert set(schema["required"]) == {"assessment", "update", "next"}
    assert set(schema["properties"]) == {"assessment", "update", "next"}
    assert schema["additionalProperties"] is False



# -- text that is not valid Unicode ------------------------------------------------------

SURROGATE = "\ud800"  # json.dumps writes it as the escape \ud800: legal JSON syntax,
# but not a Unicode scalar value, so it cannot be stored as UTF-8 (RFC 7493 forbids it).


@pytest.mark.parametrize("arguments", [
    {"prefix": SURROGATE},
    {SURROGATE: "x"},
    {"sql": "SELECT ? AS v", "params": [SURROGATE]},
], ids=["value", "key", "nested"])
def test_unpaired_surrogate_escape_is_refused(arguments: dict[str, Any]) -> None:
    text = json.dumps(reply(next={"action": "query", "operation": "source.list",
                                  "arguments": arguments}))
    assert "\\ud800" in text and text.isascii()
    assert code_of(text).startswith("REPLY_")


def test_unpaired_surrogate_in_typed_text_is_refused() -> None:
    assert code_of(with_path(("update", "note"), SURROGATE)) in ("REPLY_NOT_JSON",
                                                                 "REPLY_SCHEMA_INVALID")


def test_paired_surrogate_escapes_are_ordinary_text() -> None:
    text = json.dumps(reply(next={"action": "query", "operation": "source.search",
                                  "arguments": {"pattern": "\U0001f600"}}))
    assert "\\ud83d\\ude00" in text
    parsed = parse_reply(text)
    assert isinstance(parsed.next, QueryAction)
    assert parsed.next.arguments == {"pattern": "\U0001f600"}


@pytest.mark.parametrize("bad", ["stop\x00here",
                                 # invisible tag characters: hidden words in an audit note
                                 "ok" + "".join(chr(0xE0000 + ord(c)) for c in "hidden")])
@pytest.mark.parametrize("field", ["note", "reason", "question"])
def test_control_characters_in_text_fields_are_refused(field: str, bad: str) -> None:
    import json as _json

    from investigation.loop.contract import ReplyRejected, parse_reply

    data = {"assessment": None,
            "update": {"confidence": "weak", "evidence_ids": [], "resolve_questions": [],
                       "new_questions": [bad] if field == "question" else [],
                       "note": bad if field == "note" else "ok"},
            "next": {"action": "finish", "reason": bad if field == "reason" else "done"}}
    with pytest.raises(ReplyRejected) as err:
        parse_reply(_json.dumps(data))
    assert err.value.code == "REPLY_SCHEMA_INVALID"
    data["update"]["note"] = "tabs\tand\nnew lines are fine"
    data["update"]["new_questions"] = []
    data["next"]["reason"] = "done"
    assert parse_reply(_json.dumps(data)).update.note.startswith("tabs")


def test_a_schema_rejection_names_the_unexpected_key_first() -> None:
    """A small model answered {"hypothesis": {...}} and was told only "assessment: missing;
    update: missing; next: missing; and 1 more": the key that was not in the schema, the
    fault that says what it did wrong, was left out, and the model sent the same reply
    again (a real model's user's trial)."""
    with pytest.raises(ReplyRejected) as info:
        parse_reply(json.dumps({"hypothesis": {"balance_units": 60}}))
    assert info.value.detail == ("not in the reply schema: hypothesis; missing: assessment, "
                                 "update, next")


def test_a_schema_rejection_with_many_faults_ends_with_a_whole_count() -> None:
    doc = {f"key{i}": i for i in range(40)}
    doc["update"] = {"confidence": "x" * 50, "evidence_ids": 7, "note": 3,
                     "resolve_questions": "no", "new_questions": {}}
    with pytest.raises(ReplyRejected) as info:
        parse_reply(json.dumps(doc))
    detail = info.value.detail
    assert len(detail) < 500 and re.search(r"; and \d+ more$", detail), detail
    assert detail.startswith("not in the reply schema: key0, key1, ")
