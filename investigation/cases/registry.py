"""Case inputs and registration (``investigate case add``).

Inputs (DESIGN.md "Fixed interfaces"):

* the interpretation: a JSON object with at least ``"summary"``, a non-empty string;
  other keys are kept exactly as given;
* the hypotheses: a non-empty JSON array of ``{"id": int, "statement": str, ...}`` objects,
  ids positive and unique (``true``/``false`` are not integers), statements non-empty and
  distinct as a reader sees them (:func:`_as_read`);
  other keys are kept, and the order given is the batch order.
* in both, every string (keys too) is text: no control character but TAB, LF and CRLF,
  no bidirectional embedding, override or isolate (:data:`_NOT_TEXT`), and the summary
  and each statement show a visible character.

JSON with duplicate object keys or non-finite numbers (``NaN``, ``Infinity``) is refused,
so every accepted input has exactly one canonical JSON form.

Registration stores, in one transaction, the package bytes (:class:`PackageRecord`,
shared by every case of the same package), the :class:`CaseRecord`, analysis revision 1
(:class:`RevisionRecord`) and one immutable :class:`HypothesisBirth` per hypothesis. The
case id is derived from the inputs::

    "case-" + sha256(canonical_json([package_id, interpretation, hypotheses]))[:16]

so registering the same inputs again returns the same id and changes nothing.

Error codes (:class:`~investigation.errors.InvestigationError`):
``CASE_INTERPRETATION_INVALID``, ``CASE_HYPOTHESES_INVALID``, ``CASE_NOT_FOUND``,
``CASE_ID_CONFLICT`` (an existing case with this id holds other inputs - a hash
collision or a tampered store), ``CASE_PACKAGE_CORRUPT`` (stored package bytes no longer
match their id); package validation raises :class:`~investigation.errors.PackageError`.
"""

from __future__ import annotations

import hashlib
import math
import re
import unicodedata
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sqlalchemy.exc import DBAPIError
from sqlmodel import Session, select

from investigation.cases.layout import strict_json_loads
from investigation.cases.reader import PackageReader, check_database_opens
from investigation.cases.snapshot import Snapshot
from investigation.config import canonical_json
from investigation.errors import InvestigationError, PackageError
from investigation.files import read_bounded
from investigation.store.engine import Store, is_lost_race
from investigation.store.models import CaseRecord, HypothesisBirth, PackageRecord, RevisionRecord
from investigation.text_safety import escape_text, hidden_text, visible

__all__ = [
    "case_id_for",
    "load_hypotheses",
    "load_interpretation",
    "load_snapshot",
    "register_case",
    "validate_hypotheses",
    "validate_interpretation",
]

#: Revision number of a newly registered case.
FIRST_REVISION = 1
#: Largest interpretation/hypotheses input file read, in bytes.
MAX_INPUT_BYTES = 4 << 20

#: Deepest nesting accepted in an input.
_MAX_DEPTH = 64

_INTERPRETATION = "CASE_INTERPRETATION_INVALID"
_HYPOTHESES = "CASE_HYPOTHESES_INVALID"
#: Bounds that keep every decision's context small (it carries these in full).
MAX_INTERPRETATION_BYTES = 64 << 10
MAX_HYPOTHESES = 200
MAX_STATEMENT_CHARS = 4000


# -- inputs ----------------------------------------------------------------------------------


def load_interpretation(path: str | Path) -> dict[str, Any]:
    """Read and validate an interpretation file.

    Args:
        path: a UTF-8 JSON file holding one object with a non-empty ``"summary"`` string.

    Returns:
        The object as parsed (all keys kept).

    Raises:
        InvestigationError: ``CASE_INTERPRETATION_INVALID`` (unreadable, not JSON, wrong
            shape).
    """
    return validate_interpretation(_load_json(path, _INTERPRETATION, "interpretation"))


def load_hypotheses(path: str | Path) -> list[dict[str, Any]]:
    """Read and validate a hypotheses file.

    Args:
        path: a UTF-8 JSON file holding a non-empty array of hypothesis objects.

    Returns:
        The hypotheses as parsed, in the given order (all keys kept).

    Raises:
        InvestigationError: ``CASE_HYPOTHESES_INVALID`` (unreadable, not JSON, wrong shape,
            duplicate or non-positive ids, empty statements).
    """
    return validate_hypotheses(_load_json(path, _HYPOTHESES, "hypotheses"))


def validate_interpretation(value: Any) -> dict[str, Any]:
    """Check an interpretation object (see the module docstring).

    Returns:
        ``value`` unchanged.

    Raises:
        InvestigationError: ``CASE_INTERPRETATION_INVALID``.
    """
    if not isinstance(value, dict):
        raise InvestigationError(_INTERPRETATION, "the interpretation must be a JSON object")
    _check_canonical(value, _INTERPRETATION, "the interpretation")
    summary = value.get("summary")
    if not isinstance(summary, str) or not visible(summary):
        raise InvestigationError(
            _INTERPRETATION, 'the interpretation needs "summary": a non-empty string'
            + (" (it holds only invisible characters)" if isinstance(summary, str)
               and summary.strip() else "")
        )
    _check_text(value, _INTERPRETATION, "the interpretation")
    size = len(canonical_json(value))
    if size > MAX_INTERPRETATION_BYTES:
        raise InvestigationError(_INTERPRETATION, f"the interpretation is {size} bytes; at "
                                 f"most {MAX_INTERPRETATION_BYTES} (it is in every context)")
    return value


def validate_hypotheses(value: Any) -> list[dict[str, Any]]:
    """Check a hypothesis batch (see the module docstring).

    Returns:
        ``value`` unchanged.

    Raises:
        InvestigationError: ``CASE_HYPOTHESES_INVALID``.
    """
    if not isinstance(value, list) or not value:
        raise InvestigationError(_HYPOTHESES, "the hypotheses must be a non-empty JSON array")
    if len(value) > MAX_HYPOTHESES:
        raise InvestigationError(_HYPOTHESES, f"at most {MAX_HYPOTHESES} hypotheses per batch "
                                 f"(got {len(value)})")
    _check_canonical(value, _HYPOTHESES, "the hypotheses")
    seen: set[int] = set()
    statements: dict[str, int] = {}  # a statement as compared -> the first id that holds it
    for index, item in enumerate(value):
        where = f"hypothesis #{index + 1}"
        if not isinstance(item, dict):
            raise InvestigationError(_HYPOTHESES, f"{where} must be a JSON object")
        ident = item.get("id")
        if type(ident) is not int or not 0 < ident < 2**31:
            raise InvestigationError(
                _HYPOTHESES,
                f'{where} needs "id": a positive integer below 2**31 (got {ident!r})'
            )
        if ident in seen:
            raise InvestigationError(_HYPOTHESES, f"hypothesis id {ident} is used twice",
                                     hypothesis_id=ident)
        seen.add(ident)
        statement = item.get("statement")
        if not isinstance(statement, str) or not visible(statement):
            raise InvestigationError(
                _HYPOTHESES, f'hypothesis {ident} needs "statement": a non-empty string'
                + (" (it holds only invisible characters)" if isinstance(statement, str)
                   and statement.strip() else ""),
                hypothesis_id=ident,
            )
        if len(statement) > MAX_STATEMENT_CHARS:
            raise InvestigationError(
                _HYPOTHESES, f"hypothesis {ident}: the statement is longer than "
                f"{MAX_STATEMENT_CHARS} characters", hypothesis_id=ident)
        if "\x00" in statement:
            raise InvestigationError(
                _HYPOTHESES, f"hypothesis {ident}: the statement holds a NUL character",
                hypothesis_id=ident,
            )
        # Two accounts of one claim spend the budget twice on it (an integrator's trial
        # registered a batch with the same statement twice).
        same = _as_read(statement)
        if same in statements:
            raise InvestigationError(
                _HYPOTHESES, f"hypotheses {statements[same]} and {ident} have the same "
                "statement; give each hypothesis its own claim", hypothesis_id=ident)
        statements[same] = ident
    for item in value:
        _check_text(item, _HYPOTHESES, f"hypothesis {item['id']}")
    return value


def case_id_for(package_id: str, interpretation: dict[str, Any],
                hypotheses: Sequence[dict[str, Any]]) -> str:
    """The deterministic case id of these inputs (``"case-"`` + 16 hex digits)."""
    digest = hashlib.sha256(canonical_json([package_id, interpretation, list(hypotheses)]))
    return "case-" + digest.hexdigest()[:16]


# -- registration ----------------------------------------------------------------------------


def _check_report(text: str) -> None:
    """Refuse a bug report without text: a case is investigated from its report.

    Checked when a case is registered, not by the package reader, so that a case stored
    before this rule still opens.

    Raises:
        PackageError: ``PKG_REPORT_INVALID`` (empty or only whitespace).
    """
    if not visible(text):
        raise PackageError("PKG_REPORT_INVALID",
                           "the package's bug report is empty; a case needs the report it "
                           "investigates (rebuild with `investigate case build --report`)")


def register_case(
    store: Store,
    package: bytes,
    interpretation: dict[str, Any],
    hypotheses: list[dict[str, Any]],
    reader: PackageReader,
) -> str:
    """Validate and register a case in one transaction; idempotent for the same inputs.

    Args:
        store: the SQL store (schema created).
        package: the case package ZIP bytes.
        interpretation: the accepted interpretation (see :func:`validate_interpretation`).
        hypotheses: the initial hypothesis batch (see :func:`validate_hypotheses`).
        reader: validates the package within its limits.

    Returns:
        The case id. Registering the same inputs again returns it and writes nothing.

    Raises:
        PackageError: the package fails validation, or, for a new case,
            ``PKG_REPORT_INVALID`` (its bug report is empty or only whitespace) or
            ``PKG_DB_CORRUPT`` (SQLite cannot open one of its databases); nothing is
            stored.
        InvestigationError: ``CASE_INTERPRETATION_INVALID``, ``CASE_HYPOTHESES_INVALID``,
            ``CASE_ID_CONFLICT``. On any error nothing is stored.
    """
    validate_interpretation(interpretation)
    validate_hypotheses(hypotheses)
    data = bytes(package)
    snapshot = reader.read(data)
    package_id = snapshot.package_id
    case_id = case_id_for(package_id, interpretation, hypotheses)
    interpretation_json = canonical_json(interpretation).decode("utf-8")
    hypotheses_sha256 = hashlib.sha256(canonical_json(hypotheses)).hexdigest()
    try:
        with store.session() as session:
            existing = session.get(CaseRecord, case_id)
            if existing is not None:
                _check_same_case(session, existing, package_id, interpretation_json,
                                 hypotheses_sha256)
                return case_id
            _check_report(snapshot.report_text())
            for name in snapshot.db_names():
                check_database_opens(name, snapshot.db_bytes(name), "DB")
            if session.get(PackageRecord, package_id) is None:
                session.add(PackageRecord(
                    id=package_id, size_bytes=len(data),
                    manifest_json=canonical_json(dict(snapshot.manifest)).decode("utf-8"),
                    data=data,
                ))
                session.flush()
            session.add(CaseRecord(id=case_id, package_id=package_id,
                                   current_revision=FIRST_REVISION))
            session.flush()
            session.add(RevisionRecord(
                case_id=case_id, revision=FIRST_REVISION,
                interpretation_json=interpretation_json, hypotheses_sha256=hypotheses_sha256,
            ))
            for hypothesis in hypotheses:
                session.add(_birth_record(case_id, FIRST_REVISION, hypothesis))
            session.flush()
    except DBAPIError as exc:
        if not is_lost_race(exc):
            raise
        # A concurrent registration of the same inputs won the race (a unique violation,
        # or a serialization failure on PostgreSQL): verify and reuse it.
        with store.session() as session:
            existing = session.get(CaseRecord, case_id)
            if existing is None:
                raise
            _check_same_case(session, existing, package_id, interpretation_json,
                             hypotheses_sha256)
    return case_id


def load_snapshot(store: Store, case_id: str, reader: PackageReader) -> Snapshot:
    """Open the package of a registered case.

    Args:
        store: the SQL store.
        case_id: a registered case id.
        reader: validates the stored bytes (cached per hash and limits).

    Returns:
        The case's :class:`~investigation.cases.reader.PackageSnapshot`.

    Raises:
        InvestigationError: ``CASE_NOT_FOUND``, ``CASE_PACKAGE_CORRUPT``.
        PackageError: the stored package fails validation under ``reader``'s limits.
    """
    with store.session() as session:
        case = session.get(CaseRecord, case_id)
        if case is None:
            raise InvestigationError("CASE_NOT_FOUND", f"no case {case_id!r}; see `case add`",
                                     case_id=case_id)
        record = session.get(PackageRecord, case.package_id)
        if record is None:
            raise InvestigationError("CASE_PACKAGE_CORRUPT",
                                     f"the package of case {case_id} is missing from the store",
                                     case_id=case_id)
        data = bytes(record.data)
    snapshot = reader.read(data)
    if snapshot.package_id != case.package_id:
        raise InvestigationError(
            "CASE_PACKAGE_CORRUPT",
            f"the stored package of case {case_id} no longer matches its sha256 id",
            case_id=case_id,
        )
    return snapshot


# -- internals -------------------------------------------------------------------------------


def _birth_record(case_id: str, revision: int, hypothesis: dict[str, Any]) -> HypothesisBirth:
    record = canonical_json(hypothesis)
    return HypothesisBirth(
        case_id=case_id, revision=revision, hypothesis_id=hypothesis["id"],
        statement=hypothesis["statement"], record_json=record.decode("utf-8"),
        record_sha256=hashlib.sha256(record).hexdigest(),
    )


def _check_same_case(session: Session, case: CaseRecord, package_id: str,
                     interpretation_json: str, hypotheses_sha256: str) -> None:
    first = session.exec(
        select(RevisionRecord).where(RevisionRecord.case_id == case.id,
                                     RevisionRecord.revision == FIRST_REVISION)
    ).first()
    if (case.package_id != package_id or first is None
            or first.interpretation_json != interpretation_json
            or first.hypotheses_sha256 != hypotheses_sha256):
        raise InvestigationError(
            "CASE_ID_CONFLICT",
            f"case {case.id} exists with other inputs; the store may have been altered",
            case_id=case.id,
        )


def _load_json(path: str | Path, code: str, what: str) -> Any:
    try:  # a regular file (never a FIFO that waits for a writer), at most MAX_INPUT_BYTES
        raw = read_bounded(path, MAX_INPUT_BYTES)
    except OSError as exc:
        raise InvestigationError(code, f"cannot read the {what} file {path}: {exc.strerror}",
                                 path=str(path)) from exc
    try:
        return strict_json_loads(raw.decode("utf-8", "strict"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise InvestigationError(code, f"the {what} file {path} is not valid UTF-8 JSON: {exc}",
                                 path=str(path)) from exc


#: Characters that show as blank space: the Hangul fillers and the blank Braille pattern.
_BLANKS = frozenset("\u115f\u1160\u3164\uffa0\u2800")
#: Format characters that show a sign (prepended concatenation marks such as U+0600, the
#: Arabic number sign, and U+06DD, the end of ayah): kept, they are seen.
_VISIBLE_FORMAT = frozenset("\u0600\u0601\u0602\u0603\u0604\u0605\u06dd\u070f"
                            "\u0890\u0891\u08e2\U000110bd\U000110cd")


def _shows_nothing(c: str) -> bool:
    """A format character that shows nothing (zero-width space, joiners, direction
    marks, word joiner, soft hyphen, tag characters, BOM), a variation selector, the
    grapheme joiner or Khmer's invisible inherent vowels: marks that change no letter
    (other combining marks, Thai vowels or Arabic harakat, are kept)."""
    code = ord(c)
    return (unicodedata.category(c) == "Cf" and c not in _VISIBLE_FORMAT) or \
        0xFE00 <= code <= 0xFE0F or 0xE0100 <= code <= 0xE01EF or code == 0x034F or \
        0x180B <= code <= 0x180F or code in (0x17B4, 0x17B5)


def _same_letters(c: str) -> str:
    """A fullwidth form (U+FF01-U+FF5E) or a Latin or Armenian ligature (U+FB00-U+FB17)
    as the letters it shows; any other character as it is. (Full compatibility
    normalisation would also make x² and x2, H₂O and H2O, Ⅳ and IV the same, which
    are different claims, a re-trial.)"""
    code = ord(c)
    if 0xFF01 <= code <= 0xFF5E or 0xFB00 <= code <= 0xFB17:
        return unicodedata.normalize("NFKC", c)
    return c


def _as_read(statement: str) -> str:
    """A statement as a reader sees it, for comparing two: composed (NFC: a decomposed
    accent as the composed one), fullwidth forms and ligatures as their letters, without
    what shows nothing (:func:`_shows_nothing`), blank fillers as spaces, runs of white
    space as one space, case folded. A hostile-input trial registered one claim twice
    behind each of these. Homoglyphs of other scripts (Cyrillic U+0430 for Latin a) are
    different letters here."""
    text = unicodedata.normalize("NFC", statement)
    kept = "".join(" " if c in _BLANKS else _same_letters(c) for c in text
                   if not _shows_nothing(c))
    return " ".join(kept.split()).casefold()


def _check_canonical(value: Any, code: str, what: str) -> None:
    """Refuse values that are not plain JSON (non-string keys, NaN, tuples, sets, ...) or
    whose strings are not text (a lone UTF-16 surrogate such as ``"\\ud800"``, which JSON
    can spell but UTF-8 cannot hold)."""
    if not _plain_json(value):
        if _depth(value) > _MAX_DEPTH:
            raise InvestigationError(
                code, f"{what} nests deeper than {_MAX_DEPTH} levels of arrays and objects")
        raise InvestigationError(
            code, f"{what} must hold plain JSON values only (objects with string keys, "
            "arrays, strings, finite numbers, booleans, null)"
        )
    try:
        canonical_json(value)
    except UnicodeEncodeError as exc:
        bad = exc.object[exc.start:exc.end] if isinstance(exc.object, str) else ""
        raise InvestigationError(
            code, f"{what}: a string is not text: it holds a lone UTF-16 surrogate "
            f"({ascii(bad)[1:-1] or 'escape'}), which UTF-8 cannot encode"
        ) from exc
    except ValueError as exc:  # an integer past Python's 4,300 digits for str()
        raise InvestigationError(
            code, f"{what}: a number has more than 4,300 digits") from exc


#: What an interpretation or hypothesis string may not hold: C0 controls but TAB, LF and
#: the CR of a CRLF, DEL, C1 controls, the line and paragraph separators, and the
#: bidirectional embeddings, overrides and isolates (U+202A-U+202E, U+2066-U+2069) that
#: reorder what a reader sees. Joiners, direction marks and other format characters that
#: scripts and emoji need (U+200C, U+200D, U+200E, U+200F, U+FE0F) are text.
_NOT_TEXT = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\u2028\u2029"
                       "\u202a-\u202e\u2066-\u2069]|\r(?!\n)")


def _check_text(value: Any, code: str, what: str) -> None:
    """Refuse a string (key or value, at any depth) of ``value`` that holds what
    :data:`_NOT_TEXT` matches (terminal escapes, bidirectional overrides): the
    interpretation and the statements go into every model prompt as written (a
    hostile-input trial); the message names where, as ``what`` at its key path.
    Iterative: ``value`` is plain JSON already (:func:`_check_canonical`)."""
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:
        where, item = stack.pop()
        if isinstance(item, dict):
            for key, inner in item.items():
                stack.append((f"{where} key {key!r}", key))
                stack.append((f"{where}.{key}" if where else str(key), inner))
        elif isinstance(item, list):
            stack.extend((f"{where}[{i}]", inner) for i, inner in enumerate(item))
        elif isinstance(item, str) and (bad := _not_text(item)) is not None:
            at = f" at {escape_text(where.strip())}" if where.strip() else ""
            raise InvestigationError(
                code, f"{what}{at}: a string holds a control character, a bidirectional "
                f"override or an invisible tag character (U+{ord(bad):04X}); printable "
                "text of any script, TAB and line breaks are taken: the text goes into "
                "every model prompt as written")


def _not_text(text: str) -> str | None:
    """The first character of ``text`` that :data:`_NOT_TEXT` matches or that is hidden
    text (``text_safety.hidden_text``), or ``None``."""
    bad = _NOT_TEXT.search(text)
    return bad.group()[0] if bad is not None else hidden_text(text)


def _depth(value: Any, limit: int = _MAX_DEPTH + 1) -> int:
    """How many levels of arrays and objects nest in ``value`` (0 for a scalar, 1 for
    ``[1]``), counted no further than ``limit``; level by level, without recursion."""
    depth, level = 0, [value]
    while depth < limit:
        containers = [x for x in level if isinstance(x, (list, dict))]
        if not containers:
            break
        depth += 1
        level = [v for x in containers for v in (x.values() if isinstance(x, dict) else x)]
    return depth


def _plain_json(value: Any, depth: int = 0) -> bool:
    if depth > _MAX_DEPTH:
        return False
    if value is None or isinstance(value, (str, bool, int)):
        return True
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, list):
        return all(_plain_json(v, depth + 1) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain_json(v, depth + 1) for k, v in value.items())
    return False
