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
from investigation.jsonio import parse_json_int
from investigation.text_safety import hidden_text
from investigation.tools.models import ARGUMENT_MODELS

Confidence = Literal["unassessed", "weak", "plausible", "supported", "strongly_supported",
                     "weakened"]
assert set(CONFIDENCE_ORDER) == set(Confidence.__args__)  # type: ignore[attr-defined]

#: Bidirectional overrides and isolates: they reorder how audit text reads on screen.
_BIDI_CONTROLS = frozenset("\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")


def printable(value: str) -> str:
    """Text fields carry no control characters other than tab and line breaks (a NUL, for
    one, cannot be stored in PostgreSQL text and has no place in an audit note), no
    bidirectional overrides and no invisible tag or annotation characters
    (``text_safety.hidden_text``: text no reader sees)."""
    if any((ord(ch) < 0x20 and ch not in "\t\n\r") or 0x7F <= ord(ch) <= 0x9F
           or ch in _BIDI_CONTROLS for ch in value):
        raise ValueError("control characters are not allowed in text fields")
    if hidden_text(value) is not None:
        raise ValueError("invisible tag or annotation characters are not allowed in text "
                         "fields")
    return value


#: Contract limits (characters, items); the per-turn schema states the same numbers.
MAX_TEXT_CHARS = 4000
MAX_TITLE_CHARS = 200
MAX_QUESTION_CHARS = 500
MAX_NEW_QUESTIONS = 10
MAX_CITED_IDS = 50

_Printable = AfterValidator(printable)
_Text = Annotated[str, Field(min_length=1, max_length=MAX_TEXT_CHARS), _Printable]
_Id = Annotated[str, Field(min_length=1, max_length=32), _Printable]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class Assessment(_Strict):
    """Semantic assessment of the previous result (null on a hypothesis's first turn)."""

    score: int = Field(ge=0, le=100)
    reason: _Text
    evidence_ids: list[_Id] = Field(min_length=1, max_length=MAX_CITED_IDS)


class Update(_Strict):
    """Qualitative update of the selected hypothesis."""

    confidence: Confidence
    evidence_ids: list[_Id] = Field(max_length=MAX_CITED_IDS)
    resolve_questions: list[_Id] = Field(max_length=MAX_CITED_IDS)
    new_questions: list[Annotated[str, Field(min_length=1, max_length=MAX_QUESTION_CHARS),
                                  _Printable]] = Field(max_length=MAX_NEW_QUESTIONS)
    note: Annotated[str, Field(max_length=MAX_TEXT_CHARS), _Printable]


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
    title: Annotated[str, Field(min_length=1, max_length=MAX_TITLE_CHARS), _Printable]
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


#: Normalisation rules (recorded per reply; ``docs/reply-contract.md``). The raw response
#: bytes are always stored as received; only the text that is parsed is normalised.
NORMALISED_CODE_FENCE = "CODE_FENCE"
NORMALISED_RAW_CONTROL = "RAW_CONTROL_IN_STRING"
NORMALISED_NULL_ARGUMENT = "NULL_OPTIONAL_ARGUMENT"
NORMALISATION_RULES = (NORMALISED_CODE_FENCE, NORMALISED_RAW_CONTROL, NORMALISED_NULL_ARGUMENT)

_FENCE_OPENERS = ("```json", "```JSON", "```")
_RAW_ESCAPES = {"\t": "\\t", "\n": "\\n", "\r": "\\r"}


def _strip_fence(text: str) -> str | None:
    """The body of ``text`` when it is exactly one fenced block, else ``None``."""
    stripped = text.strip()
    for opener in _FENCE_OPENERS:
        if stripped.startswith(opener) and stripped.endswith("```") \
                and len(stripped) >= len(opener) + 3:
            body = stripped[len(opener):-3]
            if "```" in body or not body.startswith(("\n", "\r\n", " ", "{")):
                return None
            return body
    return None


def _escape_raw_controls(text: str) -> str | None:
    """``text`` with raw tab, newline and carriage return inside JSON strings escaped;
    ``None`` when there are none (outside strings they are whitespace and stay)."""
    if "\n" not in text and "\t" not in text and "\r" not in text:
        return None  # no raw control at all (a compact reply): nothing to scan
    out: list[str] = []
    in_string = escaped = changed = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
            elif ch in _RAW_ESCAPES:
                out.append(_RAW_ESCAPES[ch])
                changed = True
                continue
        elif ch == '"':
            in_string = True
        out.append(ch)
    return "".join(out) if changed else None


def normalise_reply_text(text: str) -> tuple[str, tuple[str, ...]]:
    """Undo what real models commonly add around or inside an otherwise valid reply.

    Rules, in order (each applied at most once, and only when it changes the text):

    * ``CODE_FENCE``: the whole reply is one Markdown code block (```` ```json ... ``` ````
      or ```` ``` ... ``` ````): the fence is removed.
    * ``RAW_CONTROL_IN_STRING``: a raw tab, newline or carriage return inside a JSON
      string (several grammar-constrained servers let them through) becomes its escape.

    Returns:
        The text to parse and the rules applied, in order.
    """
    applied: list[str] = []
    body = _strip_fence(text)
    if body is not None:
        text = body
        applied.append(NORMALISED_CODE_FENCE)
    escaped = _escape_raw_controls(text)
    if escaped is not None:
        text = escaped
        applied.append(NORMALISED_RAW_CONTROL)
    return text, tuple(applied)


def _drop_null_optional_arguments(data: dict[str, Any]) -> bool:
    """Drop ``null`` values of optional query arguments (a dialect that must send every
    property sends an absent one as null); ``True`` when one was dropped."""
    nxt = data.get("next")
    if not isinstance(nxt, dict) or nxt.get("action") != "query":
        return False
    arguments = nxt.get("arguments")
    operation = nxt.get("operation")
    model = ARGUMENT_MODELS.get(operation) if isinstance(operation, str) else None
    if model is None or not isinstance(arguments, dict):
        return False
    optional = {name for name, field in model.model_fields.items() if not field.is_required()}
    nulls = [k for k, v in arguments.items() if v is None and k in optional]
    for k in nulls:
        del arguments[k]
    return bool(nulls)


#: Characters of a schema rejection's detail spent on naming faults, below the detail's
#: own bound (``ReplyRejected``: 500) so that "and N more" is never cut off.
_SCHEMA_DETAIL_CHARS = 440


def _schema_problem(exc: ValidationError) -> str:
    """The schema errors of a reply, the most telling first: every key the schema does not
    have, then every missing field, each group in one part, then the others with their
    location and what was found there, as many as fit the detail; "and N more" counts
    the rest. A small model answered ``{"hypothesis": ...}`` and was told only "assessment:
    missing; update: missing; next: missing; and 1 more": the unexpected key, the one
    fault that says what it did wrong, was the one left out, and it sent the same reply
    again (a real model's user's trial)."""
    errors = exc.errors(include_url=False)

    def where(error: Any) -> str:
        return ".".join(str(p) for p in error["loc"]) or "reply"

    extra = [where(e) for e in errors if e["type"] == "extra_forbidden"]
    missing = [where(e) for e in errors if e["type"] == "missing"]
    parts = []
    if extra:
        parts.append(f"not in the reply schema: {', '.join(extra)}")
    if missing:
        parts.append(f"missing: {', '.join(missing)}")
    for error in errors:
        if error["type"] in ("extra_forbidden", "missing"):
            continue
        found = error.get("input")
        shown = json.dumps(found, ensure_ascii=False)[:60] if isinstance(
            found, str | int | float | bool) or found is None else type(found).__name__
        parts.append(f"{where(error)}: {error['msg']} (got {shown})")
    kept: list[str] = []
    for part in parts:
        if kept and len("; ".join([*kept, part])) > _SCHEMA_DETAIL_CHARS:
            break
        kept.append(part[:_SCHEMA_DETAIL_CHARS])
    more = len(parts) - len(kept)
    return "; ".join(kept) + (f"; and {more} more" if more > 0 else "")


def read_reply(text: str) -> tuple[Reply, tuple[str, ...]]:
    """Normalise (:func:`normalise_reply_text`), then parse and schema-check one reply.

    Returns:
        The reply and the normalisation rules applied (``NULL_OPTIONAL_ARGUMENT`` when an
        optional query argument was sent as ``null`` and dropped).

    Raises:
        ReplyRejected: ``REPLY_NOT_JSON``, ``REPLY_DUPLICATE_KEYS`` or
            ``REPLY_SCHEMA_INVALID``, with the fault's location in the detail.
    """
    text, applied = normalise_reply_text(text)
    data = _load(text)
    if _drop_null_optional_arguments(data):
        applied += (NORMALISED_NULL_ARGUMENT,)
    return _validated(data), applied


def parse_reply(text: str) -> Reply:
    """Parse and schema-check one reply text exactly as given (no normalisation).

    Raises:
        ReplyRejected: ``REPLY_NOT_JSON``, ``REPLY_DUPLICATE_KEYS`` or ``REPLY_SCHEMA_INVALID``.
    """
    return _validated(_load(text))


def _load(text: str) -> dict[str, Any]:
    try:
        data = json.loads(text.strip(), object_pairs_hook=_no_duplicate_keys,
                          parse_constant=_reject_constant, parse_int=parse_json_int)
    except ReplyRejected:
        raise
    except RecursionError as exc:
        raise ReplyRejected("REPLY_NOT_JSON", "the reply nests too deeply") from exc
    except ValueError as exc:
        raise ReplyRejected("REPLY_NOT_JSON", f"the reply is not one JSON object: {exc}"
                            + _excerpt_at(text.strip(), exc)) from exc
    if not isinstance(data, dict):
        raise ReplyRejected("REPLY_NOT_JSON",
                            f"the reply must be a JSON object, got a {type(data).__name__}")
    try:  # I-JSON (RFC 7493): every string is Unicode, so it can be stored as UTF-8
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ReplyRejected("REPLY_NOT_JSON",
                            "the reply holds an unpaired surrogate escape (not Unicode)") from exc
    return data


def _excerpt_at(text: str, exc: ValueError) -> str:
    pos = getattr(exc, "pos", None)
    if not isinstance(pos, int):
        return ""
    return f" near {json.dumps(text[max(0, pos - 20):pos + 20], ensure_ascii=True)}"


def _validated(data: dict[str, Any]) -> Reply:
    try:
        return Reply.model_validate(data)
    except ValidationError as exc:
        raise ReplyRejected("REPLY_SCHEMA_INVALID", _schema_problem(exc)) from exc


@lru_cache(maxsize=1)
def reply_json_schema() -> dict[str, Any]:
    """The reply's JSON Schema (sent to providers with structured output)."""
    return Reply.model_json_schema()
