"""Tests of case inputs and registration (investigation.cases.registry)."""

from __future__ import annotations

import hashlib
import json
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlmodel import select

from investigation.cases import registry
from investigation.cases.builder import build_package
from investigation.cases.reader import PackageReader
from investigation.cases.registry import (
    load_hypotheses,
    load_interpretation,
    load_snapshot,
    register_case,
)
from investigation.config import PackageLimits, canonical_json
from investigation.errors import InvestigationError, PackageError
from investigation.store import Store
from investigation.store.models import CaseRecord, HypothesisBirth, PackageRecord, RevisionRecord

INTERPRETATION: dict[str, Any] = {"summary": "Checkout double-charges", "scope": ["billing"]}
HYPOTHESES: list[dict[str, Any]] = [
    {"id": 1, "statement": "The retry loop resubmits the charge", "origin": "triage"},
    {"id": 2, "statement": "The idempotency key is not stored"},
]
TABLES = (PackageRecord, CaseRecord, RevisionRecord, HypothesisBirth)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    s = Store("sqlite:///" + str(tmp_path / "s.db"))
    s.create_schema()
    yield s
    s.dispose()


@pytest.fixture
def package(tmp_path: Path) -> bytes:
    src = tmp_path / "src"
    src.mkdir()
    (src / "pay.py").write_bytes(b"def charge():\n    pass\n")
    (tmp_path / "report.md").write_text("Customers are charged twice.\n", encoding="utf-8")
    build_package(src, tmp_path / "report.md", tmp_path / "case.zip")
    return (tmp_path / "case.zip").read_bytes()


@pytest.fixture
def reader() -> PackageReader:
    return PackageReader(PackageLimits())


def _counts(store: Store) -> dict[str, int]:
    with store.session() as session:
        return {t.__tablename__: len(session.exec(select(t)).all()) for t in TABLES}


def _write(tmp_path: Path, name: str, value: Any) -> Path:
    path = tmp_path / name
    path.write_text(value if isinstance(value, str) else json.dumps(value), encoding="utf-8")
    return path


# -- inputs ----------------------------------------------------------------------------------


def test_load_inputs_keep_extra_keys(tmp_path: Path) -> None:
    assert load_interpretation(_write(tmp_path, "i.json", INTERPRETATION)) == INTERPRETATION
    assert load_hypotheses(_write(tmp_path, "h.json", HYPOTHESES)) == HYPOTHESES


@pytest.mark.parametrize("value", [
    [], "text", {}, {"summary": ""}, {"summary": "   "}, {"summary": 3},
    '{"summary": "a", "summary": "b"}', '{"summary": "a", "x": NaN}', "{broken",
    # invisible, or holding terminal escapes or bidirectional overrides (a hostile-input
    # trial: they went into every model prompt as written)
    {"summary": "\u200b\u200b"}, {"summary": "sum\x1b[31mRED"},
    {"summary": "ok", "notes": ["fine", {"deep": "a\u202eb"}]}, {"summary": "ok", "\x07": 1},
    {"summary": "lone CR\rover"}, {"summary": "a\u2066b"}, {"summary": "a\x85b"},
    # invisible tag and annotation characters: text no reader sees reached the model (a
    # hostile upstream trial)
    {"summary": "a\U000e0041\U000e0042 hidden"}, {"summary": "a\ufff9b"},
    {"summary": "ok", "notes": ["\U000e0069\U000e0067\U000e006e"]},
])
def test_bad_interpretation(tmp_path: Path, value: Any) -> None:
    with pytest.raises(InvestigationError) as err:
        load_interpretation(_write(tmp_path, "i.json", value))
    assert err.value.code == "CASE_INTERPRETATION_INVALID"


@pytest.mark.parametrize("value", [
    [], {}, [1], [{"statement": "s"}], [{"id": 0, "statement": "s"}],
    [{"id": -1, "statement": "s"}], [{"id": True, "statement": "s"}],
    [{"id": 1.0, "statement": "s"}], [{"id": "1", "statement": "s"}],
    [{"id": 1, "statement": ""}], [{"id": 1}],
    [{"id": 1, "statement": "a"}, {"id": 1, "statement": "b"}], "[1,",
    [{"id": 1, "statement": "\u200b"}], [{"id": 1, "statement": "ESC\x1b]0;PWNED\x07"}],
    [{"id": 1, "statement": "\u202eevil\r\nfake line"}],
    [{"id": 1, "statement": "s", "tags": ["\u2066x"]}],
    [{"id": 1, "statement": "claim\U000e0069\U000e0067\U000e006e\U000e006f\U000e0072\U000e0065"}],
    # a flag's frame around other tags: a hostile re-trial's "IGNORE ALL RULES"
    [{"id": 1, "statement": "claim \U0001f3f4\U000e0049\U000e0047\U000e004e\U000e007f"}],
    [{"id": 1, "statement": "claim \U0001f3f4\U000e0069\U000e0067\U000e006e\U000e006f"
      "\U000e0072\U000e0065\U000e007f"}],
    [{"id": 1, "statement": "claim \U000e0002"}],  # unassigned, in the Tags block
])
def test_bad_hypotheses(tmp_path: Path, value: Any) -> None:
    with pytest.raises(InvestigationError) as err:
        load_hypotheses(_write(tmp_path, "h.json", value))
    assert err.value.code == "CASE_HYPOTHESES_INVALID"


def test_two_hypotheses_of_one_statement_are_refused(tmp_path: Path) -> None:
    """Two accounts of one claim would spend the budget twice on it (an integrator's
    trial); the statements are compared ignoring case and runs of white space."""
    with pytest.raises(InvestigationError) as err:
        load_hypotheses(_write(tmp_path, "h.json", [
            {"id": 1, "statement": "The discount is divided by 10."},
            {"id": 2, "statement": "Another claim."},
            {"id": 3, "statement": "the discount  is divided\nby 10."}]))
    assert err.value.code == "CASE_HYPOTHESES_INVALID"
    assert err.value.message == ("hypotheses 1 and 3 have the same statement; give each "
                                 "hypothesis its own claim")
    taken = load_hypotheses(_write(tmp_path, "ok.json", [
        {"id": 1, "statement": "divided by 10"}, {"id": 2, "statement": "divided by 100"}]))
    assert len(taken) == 2


@pytest.mark.parametrize("hidden", [
    "The cafe\u0301 total is divided by 10.",  # NFD against NFC
    "\ufeffThe café total is divided by 10.", "The\u200b café total is divided by 10.",
    "The café total i\u00ads divided by 10.", "\uff34he café total is divided by 10.",
    "The café total\u2060 is divided by 10.", "The café total is divided by 10.\ufe0f",
    "The\u3164café total is divided by 10.", "The café total\U000e0020 is divided by 10.",
    "The café to\u034ftal is divided by 10.", "The café total\u180b is divided by 10.",
    "The\u2800café total is divided by 10.", "The café total \u200c\u200dis divided by 10.",
    "The café to\u17b4tal is divided by 10.",
])
def test_one_claim_behind_invisible_characters_is_refused(tmp_path: Path, hidden: str) -> None:
    """A hostile-input trial registered one visible claim twice behind each of these."""
    with pytest.raises(InvestigationError) as err:
        load_hypotheses(_write(tmp_path, "h.json", [
            {"id": 1, "statement": "The café total is divided by 10."},
            {"id": 2, "statement": hidden}]))
    assert err.value.message.startswith("hypotheses 1 and 2 have the same statement")


def test_statements_that_differ_in_a_letter_or_mark_are_taken(tmp_path: Path) -> None:
    for pair in (("café", "cafe"), ("กิน", "กน"), ("division by 10", "division by 1O"),
                 ("x\u00b2 overflows", "x2 overflows"), ("H\u2082O", "H2O"),
                 ("\u2163 rounds", "IV rounds"), ("\u0600 5 rounds", " 5 rounds")):
        assert len(load_hypotheses(_write(tmp_path, "h.json", [
            {"id": 1, "statement": pair[0]}, {"id": 2, "statement": pair[1]}]))) == 2


def test_text_with_tabs_line_breaks_and_any_script_is_taken(tmp_path: Path) -> None:
    """Only controls and bidirectional overrides are refused: TAB, LF, CRLF, any script,
    the joiners and direction marks scripts and emoji need (Persian's U+200C, emoji's
    U+200D, a Hebrew U+200F: a trial's pasted text was refused) are text."""
    hypotheses = [{"id": 1, "statement": "line one\n\tline two: \u05e9\u05dc\u05d5\u05dd "
                   "\u6570\u636e \u2713"},
                  {"id": 2, "statement": "\u0645\u06cc\u200c\u062e\u0648\u0627\u0647\u0645 "
                   "\U0001f468\u200d\U0001f469\u200d\U0001f467 \U0001f3f3\ufe0f\u200d"
                   "\U0001f308 \u05e9\u05dc\u05d5\u05dd\u200f windows\r\nline"},
                  # a subdivision flag is a tag sequence: its tags are what they are for
                  {"id": 3, "statement": "\U0001f3f4\U000e0067\U000e0062\U000e0073\U000e0063"
                   "\U000e0074\U000e007f Scotland"}]
    assert load_hypotheses(_write(tmp_path, "h.json", hypotheses)) == hypotheses
    interpretation = {"summary": "r\u00e9sum\u00e9\n\tdetail", "extra": {"k": "\u0645\u0631\u062d\u0628\u0627"}}
    assert load_interpretation(_write(tmp_path, "i.json", interpretation)) == interpretation


def test_a_refused_character_is_named_with_its_hypothesis_and_key(tmp_path: Path) -> None:
    """With six hypotheses and an escape in the sixth, the message named none (a trial)."""
    hypotheses = [{"id": i, "statement": f"s{i}"} for i in range(1, 6)] + [
        {"id": 6, "statement": "ok", "tags": ["fine", "bad\x1b[2J"]}]
    with pytest.raises(InvestigationError) as err:
        load_hypotheses(_write(tmp_path, "h.json", hypotheses))
    assert err.value.message.startswith("hypothesis 6 at tags[1]: a string holds a control "
                                        "character, a bidirectional override or an "
                                        "invisible tag character (U+001B)")
    with pytest.raises(InvestigationError) as err:
        load_interpretation(_write(tmp_path, "i.json", {"summary": "ok",
                                                         "extra": {"k\u202e": 1}}))
    assert err.value.message.startswith("the interpretation at extra key 'k\\u202e': ")


def test_a_lone_surrogate_is_refused_with_the_inputs_own_code(tmp_path: Path) -> None:
    """JSON can spell a lone UTF-16 surrogate (\\ud800), which UTF-8 cannot hold: it was
    INPUT_INVALID, 'position 107' of no file (a hostile-input trial)."""
    for name, text, load, code in (
            ("h.json", '[{"id": 1, "statement": "\\ud800"}]', load_hypotheses,
             "CASE_HYPOTHESES_INVALID"),
            ("i.json", '{"summary": "ok", "note": {"\\udfff": 1}}', load_interpretation,
             "CASE_INTERPRETATION_INVALID")):
        (tmp_path / name).write_text(text)
        with pytest.raises(InvestigationError) as err:
            load(tmp_path / name)  # type: ignore[operator]
        assert err.value.code == code
        assert "lone UTF-16 surrogate" in err.value.message and "position" not in \
            err.value.message


def test_nesting_too_deep_says_so(tmp_path: Path) -> None:
    """500 nested arrays were refused as 'plain JSON values only' (a hostile-input
    trial); 60 still pass."""
    deep = tmp_path / "deep.json"
    deep.write_text('{"summary": "s", "x": ' + "[" * 500 + "]" * 500 + "}")
    with pytest.raises(InvestigationError) as err:
        load_interpretation(deep)
    assert err.value.code == "CASE_INTERPRETATION_INVALID"
    assert "nests deeper than 64 levels" in err.value.message
    fine = tmp_path / "fine.json"
    fine.write_text('{"summary": "s", "x": ' + "[" * 60 + "]" * 60 + "}")
    assert load_interpretation(fine)["summary"] == "s"


def test_unreadable_input_files(tmp_path: Path) -> None:
    with pytest.raises(InvestigationError) as err:
        load_interpretation(tmp_path / "missing.json")
    assert err.value.code == "CASE_INTERPRETATION_INVALID"
    with pytest.raises(InvestigationError) as err:
        load_hypotheses(tmp_path / "missing.json")
    assert err.value.code == "CASE_HYPOTHESES_INVALID"


# -- registration ----------------------------------------------------------------------------


def test_register_round_trip(store: Store, package: bytes, reader: PackageReader) -> None:
    case_id = register_case(store, package, INTERPRETATION, HYPOTHESES, reader)
    assert case_id.startswith("case-") and len(case_id) == 21
    package_id = hashlib.sha256(package).hexdigest()
    with store.session() as session:
        record = session.get(PackageRecord, package_id)
        assert record is not None and bytes(record.data) == package
        assert record.size_bytes == len(package)
        assert json.loads(record.manifest_json)["source_root"] == "source/"
        case = session.get(CaseRecord, case_id)
        assert case is not None and case.package_id == package_id
        assert case.current_revision == 1
        revisions = session.exec(select(RevisionRecord)).all()
        assert [(r.case_id, r.revision) for r in revisions] == [(case_id, 1)]
        assert revisions[0].interpretation_json == canonical_json(INTERPRETATION).decode()
        assert revisions[0].hypotheses_sha256 == hashlib.sha256(
            canonical_json(HYPOTHESES)).hexdigest()
        births = session.exec(select(HypothesisBirth).order_by(HypothesisBirth.hypothesis_id)
                              ).all()
        assert [(b.hypothesis_id, b.statement) for b in births] == [
            (1, HYPOTHESES[0]["statement"]), (2, HYPOTHESES[1]["statement"])]
        assert births[0].record_json == canonical_json(HYPOTHESES[0]).decode()
        assert births[0].record_sha256 == hashlib.sha256(
            canonical_json(HYPOTHESES[0])).hexdigest()

    snap = load_snapshot(store, case_id, reader)
    assert snap.package_id == package_id
    assert snap.read_source("pay.py") == b"def charge():\n    pass\n"
    assert snap.report_text() == "Customers are charged twice.\n"


def test_register_is_idempotent(store: Store, package: bytes, reader: PackageReader) -> None:
    first = register_case(store, package, INTERPRETATION, HYPOTHESES, reader)
    before = _counts(store)
    # A fresh reader (no cache) and equal-but-distinct objects give the same id.
    again = register_case(store, bytearray(package), json.loads(json.dumps(INTERPRETATION)),
                          json.loads(json.dumps(HYPOTHESES)), PackageReader())
    assert again == first
    assert _counts(store) == before == {"package": 1, "case": 1, "revision": 1,
                                        "hypothesis_birth": 2}
    other = register_case(store, package, {"summary": "another reading"}, HYPOTHESES, reader)
    assert other != first
    assert _counts(store) == {"package": 1, "case": 2, "revision": 2, "hypothesis_birth": 4}


def test_bad_package_stores_nothing(store: Store, package: bytes, reader: PackageReader) -> None:
    with pytest.raises(PackageError) as err:
        register_case(store, package[:-5], INTERPRETATION, HYPOTHESES, reader)
    assert err.value.code == "PKG_NOT_ZIP"
    with pytest.raises(InvestigationError) as err:
        register_case(store, package, {"summary": ""}, HYPOTHESES, reader)
    assert err.value.code == "CASE_INTERPRETATION_INVALID"
    with pytest.raises(InvestigationError) as err:
        register_case(store, package, INTERPRETATION, [{"id": 1, "statement": "x", "v": {1}}],
                      reader)
    assert err.value.code == "CASE_HYPOTHESES_INVALID"
    assert _counts(store) == dict.fromkeys(("package", "case", "revision", "hypothesis_birth"), 0)


def test_failure_mid_transaction_rolls_back_everything(
    store: Store, package: bytes, reader: PackageReader, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = registry._birth_record
    calls: list[int] = []

    def failing(case_id: str, revision: int, hypothesis: dict[str, Any]) -> HypothesisBirth:
        calls.append(hypothesis["id"])
        if len(calls) == 2:
            raise RuntimeError("disk on fire")
        return real(case_id, revision, hypothesis)

    monkeypatch.setattr(registry, "_birth_record", failing)
    with pytest.raises(RuntimeError):
        register_case(store, package, INTERPRETATION, HYPOTHESES, reader)
    assert calls == [1, 2]
    assert _counts(store) == dict.fromkeys(("package", "case", "revision", "hypothesis_birth"), 0)
    monkeypatch.setattr(registry, "_birth_record", real)
    case_id = register_case(store, package, INTERPRETATION, HYPOTHESES, reader)
    assert load_snapshot(store, case_id, reader).source_paths() == ["pay.py"]


def test_load_snapshot_unknown_case(store: Store, reader: PackageReader) -> None:
    with pytest.raises(InvestigationError) as err:
        load_snapshot(store, "case-0000000000000000", reader)
    assert err.value.code == "CASE_NOT_FOUND"


def _refusals(store: Store, reader: PackageReader, tmp_path: Path, report: bytes,
              db: bytes | None = None) -> tuple[PackageError, PackageError]:
    """The refusal of a crafted package with ``report`` (and ``db/app.sqlite``) at
    registration, which must store nothing, and of ``case build`` of the same inputs,
    which must write nothing. The reader itself opens the package (a case stored before
    these rules keeps working)."""
    from tests.unit.test_package_reader import BASE
    from tests.unit.test_package_reader import package as crafted

    files = {**BASE, "report.md": report} | ({"db/app.sqlite": db} if db is not None else {})
    data = crafted(files=files)
    reader.read(data)
    with pytest.raises(PackageError) as registered:
        register_case(store, data, INTERPRETATION, HYPOTHESES, reader)
    assert _counts(store) == dict.fromkeys(("package", "case", "revision", "hypothesis_birth"), 0)
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.py").write_bytes(b"x = 1\n")
    (tmp_path / "report.md").write_bytes(report)
    if db is not None:
        (tmp_path / "app.db").write_bytes(db)
    with pytest.raises(PackageError) as built:
        build_package(src, tmp_path / "report.md", tmp_path / "case.zip",
                      db=tmp_path / "app.db" if db is not None else None)
    assert not (tmp_path / "case.zip").exists()
    return registered.value, built.value


@pytest.mark.parametrize("report", [b"", b"  \n\t\n", "\u200b\u200b\n".encode()])
def test_a_package_without_a_bug_report_is_refused(
        store: Store, reader: PackageReader, tmp_path: Path, report: bytes) -> None:
    """A case is investigated from its report: an empty one is refused by `case build` and,
    for a package made elsewhere, by registration."""
    for err in _refusals(store, reader, tmp_path, report):
        assert err.code == "PKG_REPORT_INVALID" and "empty" in err.message


def _malformed_schema() -> bytes:
    conn = sqlite3.connect(":memory:")
    conn.execute("CREATE TABLE t (x)")
    conn.execute("PRAGMA writable_schema = ON")
    conn.execute("UPDATE sqlite_master SET sql = 'create table t(x' WHERE name = 't'")
    conn.commit()
    data = conn.serialize()
    conn.close()
    return data


@pytest.mark.parametrize("db", [
    b"SQLite format 3\x00" + bytes(range(256)) * 16,   # the header, then noise
    "schema",                                           # a schema SQLite cannot parse
])
def test_a_database_sqlite_cannot_open_is_refused(
        store: Store, reader: PackageReader, tmp_path: Path, db: bytes | str) -> None:
    """A package whose database has the SQLite header but cannot be opened was accepted;
    every db operation then failed and the case blocked as if the model had replied
    badly (INVALID_LLM_RESPONSES). `case build` and registration refuse it."""
    data_db = _malformed_schema() if db == "schema" else db
    assert isinstance(data_db, bytes)
    registered, built = _refusals(store, reader, tmp_path, b"It breaks.\n", data_db)
    for err in (registered, built):
        assert err.code == "PKG_DB_CORRUPT" and "app.sqlite" in err.message
        assert "integrity_check" in err.message
