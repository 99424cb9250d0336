"""The model/controller reply contract (seed 000, "Model/controller contract").

A reply is exactly one JSON object ``{"assessment", "update", "next"}``. The models here
are strict: unknown keys, missing keys, wrong types (no coercion) and duplicate JSON
keys are refused. The controller owns every id, deadline, cost, refund and balance: no
field of the reply can set one.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError

from investigation.constants import CONFIDENCE_ORDER

Confidence = Literal["unassessed", "weak", "plausible", "supported", "strongly_supported",
                     "weakened"]
assert set(CONFIDENCE_ORDER) == set(Confidence.__args__)  # type: ignore[attr-defined]

#: Bidirectional overrides and isolates: they reorder how audit text reads on screen.
_BIDI_CONTROLS = frozenset("\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")


def printable(value: str) -> str:
    """Text fields carry no control characters other than tab and line breaks (a NUL, for
    one, cannot be stored in PostgreSQL text and has no place in an audit note)."""
    if any((ord(ch) < 0x20 and ch not in "\t\n\r") or 0x7F <= ord(ch) <= 0x9F
           or ch in _BIDI_CONTROLS for ch in value):
        raise ValueError("control characters are not allowed in text fields")
    return value


_Printable = AfterValidator(printable)
_Text = Annotated[str, Field(min_length=1, max_length=4000), _Printable]
_Id = Annotated[str, Field(min_length=1, max_length=32), _Printable]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class Assessment(_Strict):
    """Semantic assessment of the previous result (null on a hypothesis's first turn)."""

    score: int = Field(ge=0, le=100)
    reason: _Text
    evidence_ids: list[_Id] = Field(min_length=1, max_length=50)


class Update(_Strict):
    """Qualitative update of the selected hypothesis."""

    confidence: Confidence
    evidence_ids: list[_Id] = Field(max_length=50)
    resolve_questions: list[_Id] = Field(max_length=50)
    new_questions: list[Annotated[str, Field(min_length=1, max_length=500), _Printable]] = \
        Field(max_length=10)
    note: Annotated[str, Field(max_length=4000), _Printable]


#: Largest ``next.arguments`` (canonical JSON, UTF-8 bytes): arguments stay in every later
#: context as a reference, so they must stay small.
MAX_ARGUMENTS_BYTES = 16 << 10


def _small_arguments(value: dict[str, Any]) -> dict[str, Any]:
    size = len(json.dumps(value, ensure_ascii=False, sort_keys=True,
                          separators=(",", ":")).encode("utf-8", "surrogatepass"))
    if size > MAX_ARGUMENTS_BYTES:
        raise ValueError(f"arguments are {size} bytes; at most {MAX_ARGUMENTS_BYTES}")
    return value


class QueryAction(_Strict):
    """One read-only snapshot operation."""

    action: Literal["query"]
    operation: Annotated[str, Field(min_length=1, max_length=64), _Printable]
    arguments: Annotated[dict[str, Any], AfterValidator(_small_arguments)]


class TestDescriptor(_Strict):
    """An external test handed to a human or an automated rig."""

    kind: Literal["human", "automated"]
    title: Annotated[str, Field(min_length=1, max_length=200), _Printable]
    instructions: _Text
    expected_observation: _Text


class TestAction(_Strict):
    """Hand a test descriptor out (``AWAITING_TEST_FEEDBACK``)."""

    action: Literal["test"]
    test: TestDescriptor


class EarlyDiagnosisRequest(_Strict):
    """A request, carried by ``finish``, to defer alternatives to assessment-only.

    The controller reviews it deterministically (``docs/early-diagnosis.md``); an
    accepted review leaves each deferred alternative one closing turn (finish or reject,
    assessing its pending result) instead of further research.
    """

    defer_alternatives: list[Annotated[int, Field(ge=1, lt=2**31)]] = \
        Field(min_length=1, max_length=50)
    rationale: _Text


class FinishAction(_Strict):
    """Finish the hypothesis's investigation (``investigation_finished``), optionally
    with an early-diagnosis request."""

    action: Literal["finish"]
    reason: _Text
    early_diagnosis: EarlyDiagnosisRequest | None = None


class RejectAction(_Strict):
    """Reject the hypothesis (``rejected``)."""

    action: Literal["reject"]
    reason: _Text


NextAction = Annotated[QueryAction | TestAction | FinishAction | RejectAction,
                       Field(discriminator="action")]


class Reply(_Strict):
    """The whole reply: exactly ``assessment``, ``update`` and ``next``."""

    assessment: Assessment | None
    update: Update
    next: NextAction


class ReplyRejected(Exception):
    """A reply that breaks the contract. ``code`` is carried into the next prompt.

    Args:
        code: stable rejection code (see ``docs/investigation-loop.md``).
        detail: short, safe explanation (no snapshot contents).
    """

    def __init__(self, code: str, detail: str) -> None:
        super().__init__(f"{code}: {detail}")
        self.code = code
        self.detail = detail[:500]


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [k for k, _ in pairs]
    if len(keys) != len(set(keys)):
        raise ReplyRejected("REPLY_DUPLICATE_KEYS", "a JSON object repeats a key")
    return dict(pairs)


def _reject_constant(value: str) -> Any:
    raise ReplyRejected("REPLY_NOT_JSON", f"non-standard JSON constant {value}")


def parse_reply(text: str) -> Reply:
    """Parse and schema-check one reply text.

    Raises:
        ReplyRejected: ``REPLY_NOT_JSON``, ``REPLY_DUPLICATE_KEYS`` or ``REPLY_SCHEMA_INVALID``.
    """
    try:
        data = json.loads(text.strip(), object_pairs_hook=_no_duplicate_keys,
                          parse_constant=_reject_constant)
    except ReplyRejected:
        raise
    except (ValueError, RecursionError) as exc:
        raise ReplyRejected("REPLY_NOT_JSON", f"the reply is not one JSON object: {exc}") from exc
    if not isinstance(data, dict):
        raise ReplyRejected("REPLY_NOT_JSON", "the reply must be a JSON object")
    try:  # I-JSON (RFC 7493): every string is Unicode, so it can be stored as UTF-8
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ReplyRejected("REPLY_NOT_JSON",
                            "the reply holds an unpaired surrogate escape (not Unicode)") from exc
    try:
        return Reply.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise ReplyRejected("REPLY_SCHEMA_INVALID", f"{where}: {first['msg']}") from exc


@lru_cache(maxsize=1)
def reply_json_schema() -> dict[str, Any]:
    """The reply's JSON Schema (sent to providers with structured output)."""
    return Reply.model_json_schema()
