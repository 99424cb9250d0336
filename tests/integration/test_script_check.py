"""``investigate replies check``: a reply file judged against a case without running
anything, checked against what a real run then does with the same file.

For every call the real run made, the check must have predicted whose turn it was and the
validator's verdict (a line the check calls ``depends`` may go either way; the scripts
here find new items, which is the check's first world). Nothing is written by a check.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from sqlmodel import col, select
from typer.testing import CliRunner

from investigation.constants import BLOCKED, COMPLETED
from investigation.llm.scripted import read_script_lines, script_lines
from investigation.loop.script_check import (
    ACCEPTED,
    DEPENDS,
    REJECTED_VERDICT,
    SERVED,
    UNREADABLE,
    UNUSED,
    check_script,
)
from investigation.store.models import StageRun
from tests import casekit
from tests.casekit import Case, make_case, q
from tests.longcase import long_config, make_long_case


def _actual(case: Case) -> list[tuple[int, bool, str | None]]:
    """(hypothesis, accepted, code) of every validated call of the case, in call order."""
    with case.store.session() as s:
        runs = s.exec(select(StageRun).where(StageRun.case_id == case.case_id)
                      .order_by(col(StageRun.step_seq))).all()
    built = {r.step_seq: json.loads(r.output_json) for r in runs if r.stage == "build_context"}
    out = []
    for r in runs:
        if r.stage != "validate":
            continue
        v = json.loads(r.output_json)
        if v.get("skipped"):
            continue
        out.append((int(built[r.step_seq]["hypothesis_id"]), bool(v["accepted"]),
                    v.get("code")))
    return out


def _agrees(predicted: list[Any], actual: list[tuple[int, bool, str | None]]) -> None:
    judged = [v for v in predicted if v.verdict not in (SERVED, UNUSED)]
    assert len(judged) >= len(actual)
    for v, (hid, accepted, code) in zip(judged, actual, strict=False):
        assert v.hypothesis_id == hid, (v, hid)
        if v.verdict == DEPENDS:
            continue
        assert (v.verdict == ACCEPTED) == accepted, (v, accepted, code)
        assert v.code == code, (v, code)


def test_happy_script_is_predicted_line_by_line(tiny_case: Case) -> None:
    before = tiny_case.store.url
    result = check_script(tiny_case.store, tiny_case.case_id, tiny_case.replies_path)
    assert [v.verdict for v in result.lines] == [ACCEPTED, ACCEPTED, DEPENDS, DEPENDS,
                                                 ACCEPTED]
    assert result.ok and "completes" in result.end
    assert [v.hypothesis_id for v in result.lines] == [1, 2, 1, 1, 2]
    assert "SUPPORT_WITHOUT_FINDINGS" in (result.lines[2].other or "")
    assert result.lines[-1].outcome == COMPLETED
    assert _actual(tiny_case) == []  # nothing ran, nothing was written
    assert tiny_case.store.url == before
    outcome = tiny_case.investigator().run(tiny_case.case_id, max_steps=100)
    assert outcome.outcome == COMPLETED
    _agrees(result.lines, _actual(tiny_case))


def test_long_script_with_rejections_and_questions(tmp_path: Path) -> None:
    case = make_long_case(tmp_path / "case", hypotheses=3, research_per_hypothesis=6,
                          reject_every=5)
    cfg = long_config(6)
    result = check_script(case.store, case.case_id, case.replies_path, cfg)
    rejected = [v for v in result.lines if v.verdict == REJECTED_VERDICT]
    assert rejected and all(v.code == "UNKNOWN_EVIDENCE_ID" for v in rejected)
    assert result.lines[-1].outcome == COMPLETED and not result.ok
    outcome = case.investigator(cfg).run(case.case_id, max_steps=1000)
    assert outcome.outcome == COMPLETED
    actual = _actual(case)
    assert len(actual) == len(result.lines)
    _agrees(result.lines, actual)


def test_three_invalid_replies_block_and_the_check_says_where_to_go_on(tiny_case: Case) -> None:
    bad = json.dumps(q("source.search", {"pattern": "x"}, evidence=["E9"]))
    lines = [bad, "not json", json.dumps(casekit.HAPPY_REPLIES[0]) + "x"]
    tiny_case.replies_path.write_text("\n".join(lines) + "\n")
    result = check_script(tiny_case.store, tiny_case.case_id, tiny_case.replies_path)
    assert [(v.verdict, v.code) for v in result.lines] == [
        (REJECTED_VERDICT, "UNKNOWN_EVIDENCE_ID"), (REJECTED_VERDICT, "REPLY_NOT_JSON"),
        (REJECTED_VERDICT, "REPLY_NOT_JSON")]
    assert result.lines[-1].outcome == BLOCKED
    assert any("INVALID_LLM_RESPONSES" in n for n in result.lines[-1].notes)
    assert "PROVIDER_SCRIPT_EXHAUSTED" in result.end
    outcome = tiny_case.investigator().run(tiny_case.case_id)
    assert outcome.outcome == BLOCKED and outcome.reason == "INVALID_LLM_RESPONSES"
    _agrees(result.lines, _actual(tiny_case))
    # The fixed file keeps the three served lines; line 4 answers the next call.
    fixed = lines + [json.dumps(r) for r in casekit.HAPPY_REPLIES]
    tiny_case.replies_path.write_text("\n".join(fixed) + "\n")
    again = check_script(tiny_case.store, tiny_case.case_id, tiny_case.replies_path)
    assert "after `resume`, call 4 reads reply line 4" in again.start
    assert [v.verdict for v in again.lines[:3]] == [SERVED] * 3
    assert again.ok and again.lines[-1].outcome == COMPLETED
    assert not any(n.startswith("edited") for v in again.lines for n in v.notes)
    # A served line fixed in place is named: the case keeps the reply it got (a new user
    # fixed line 2 after the block, read "served" and ran into the exhausted file).
    edited = [lines[0], json.dumps(casekit.HAPPY_REPLIES[0]), lines[2]]
    tiny_case.replies_path.write_text("\n".join(edited) + "\n")
    third = check_script(tiny_case.store, tiny_case.case_id, tiny_case.replies_path)
    assert [v.verdict for v in third.lines] == [SERVED] * 3
    assert third.lines[1].notes == [
        "edited since call 2 read it: the case keeps the reply it got, so this edit changes "
        "nothing; what comes next is read from the lines after the served ones"]
    assert not third.lines[0].notes and not third.lines[2].notes


def test_a_reply_written_over_several_lines_is_named_once(tiny_case: Case) -> None:
    """reply-contract.md's pretty-printed example pasted into a reply file was refused
    line by line (REPLY_NOT_JSON, then "Extra data") without a word on why."""
    pretty = json.dumps(casekit.HAPPY_REPLIES[0], indent=2).splitlines()
    tiny_case.replies_path.write_text("\n".join(pretty) + "\n")
    result = check_script(tiny_case.store, tiny_case.case_id, tiny_case.replies_path)
    assert {v.code for v in result.lines[:3]} == {"REPLY_NOT_JSON"}
    first = result.lines[0]
    assert f"lines 1-{len(pretty)} together are one JSON document, written over several " \
        "lines: a reply file holds one reply per line (JSON Lines)" in " ".join(first.notes)
    assert not any("one JSON document" in n for v in result.lines[1:] for n in v.notes)
    # Garbage that never joins into a document gets no such note.
    tiny_case.replies_path.write_text("{ not json\n}\n{\n")
    garbage = check_script(tiny_case.store, tiny_case.case_id, tiny_case.replies_path)
    assert not any("one JSON document" in n for v in garbage.lines for n in v.notes)


def test_the_check_judges_a_bounded_number_of_lines(tiny_case: Case,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """200,000 lines ran past two minutes and 271 MB (a hostile-input trial): lines past
    MAX_JUDGED_LINES are named in the end, not judged."""
    from investigation.loop import script_check

    monkeypatch.setattr(script_check, "MAX_JUDGED_LINES", 3)
    tiny_case.replies_path.write_text("\n".join(["not json"] * 7) + "\n")
    result = check_script(tiny_case.store, tiny_case.case_id, tiny_case.replies_path)
    assert [v.line for v in result.lines] == [1, 2, 3]
    assert result.end == ("the check stopped after judging 3 lines: lines 4-7 (4 reply "
                          "line(s)) were not judged; check them once the case has read the "
                          "lines before them")


def test_a_file_that_ends_on_a_test_hand_out_says_the_case_waits_there(
        tmp_path: Path) -> None:
    """The footer said the next call finds no reply and blocks the case
    (PROVIDER_SCRIPT_EXHAUSTED) while the run stopped at AWAITING_TEST_FEEDBACK first (a
    new user's trial)."""
    from tests.integration.test_external_tests import CFG, REPLIES

    case = make_case(tmp_path / "c", replies=REPLIES[:3])
    result = check_script(case.store, case.case_id, case.replies_path, CFG)
    assert any("AWAITING_TEST_FEEDBACK" in n for n in result.lines[-1].notes)
    assert result.end.startswith(
        "the file ends after 3 reply line(s): the case first waits for the test feedback "
        "line 3 asks for (AWAITING_TEST_FEEDBACK); once it is confirmed, call 4 finds no "
        "reply"), result.end
    outcome = case.investigator(CFG).run(case.case_id, max_steps=10)
    assert (outcome.outcome, outcome.reason) == (BLOCKED, "AWAITING_TEST_FEEDBACK")
    plain = make_case(tmp_path / "p", replies=REPLIES[:2])  # no hand-out: no wait named
    ends = check_script(plain.store, plain.case_id, plain.replies_path, CFG).end
    assert "waits" not in ends and "call 3 finds no reply" in ends, ends


def test_a_file_shorter_than_the_calls_made_names_the_reply_the_next_call_reads(
        tmp_path: Path) -> None:
    """A 3-line file against a case that made 500 calls was told "call 501 reads reply
    line 4" and "call 4 finds no reply", while `run` rightly asked for reply 501 (a
    500-step case's reader)."""
    case = make_case(tmp_path / "c", replies=casekit.HAPPY_REPLIES[:3])
    outcome = case.investigator().run(case.case_id, max_steps=10)
    assert outcome.reason == "PROVIDER_CONFIGURATION", outcome  # the script ran out
    case.replies_path.write_text(json.dumps(casekit.HAPPY_REPLIES[0]) + "\n")
    result = check_script(case.store, case.case_id, case.replies_path)
    assert result.start.endswith(
        "call 4 reads the file's reply 4, past its end (it holds 1 reply line(s) for the 3 "
        "call(s) made: call N reads the N-th reply line, blank lines not counted)"), \
        result.start
    assert [v.verdict for v in result.lines] == [SERVED]
    assert result.end.endswith(
        "call 4 finds no reply and blocks the case (PROVIDER_CONFIGURATION, "
        "PROVIDER_SCRIPT_EXHAUSTED); add replies to continue: call 4 reads the file's reply "
        "4, past its end (it holds 1 reply line(s) for the 3 call(s) made: call N reads the "
        "N-th reply line, blank lines not counted)"), result.end


def test_lines_after_completion_are_unused_and_blank_lines_keep_numbers(
        tiny_case: Case) -> None:
    text = "\n\n".join(json.dumps(r) for r in casekit.HAPPY_REPLIES) + "\n\n" + \
        json.dumps(casekit.HAPPY_REPLIES[0]) + "\n"
    tiny_case.replies_path.write_text(text)
    data = tiny_case.replies_path.read_bytes()
    assert [b for _, b in script_lines(data)] == read_script_lines(tiny_case.replies_path)
    result = check_script(tiny_case.store, tiny_case.case_id, tiny_case.replies_path)
    assert [v.line for v in result.lines] == [1, 3, 5, 7, 9, 11]
    assert result.lines[-1].verdict == UNUSED and result.ok


def test_unreadable_line_and_a_duplicate_query(tiny_case: Case) -> None:
    first = json.dumps(casekit.HAPPY_REPLIES[0])
    h2 = json.dumps(casekit.HAPPY_REPLIES[1])
    again = json.dumps(q("source.search", {"pattern": "percent / 10"}, confidence="plausible",
                         assessment=(50, ["E1"]), evidence=["E1"]))
    tiny_case.replies_path.write_bytes((first + "\n" + h2 + "\n" + again + "\n").encode()
                                       + b"\xff\xfe\n")
    result = check_script(tiny_case.store, tiny_case.case_id, tiny_case.replies_path)
    assert "duplicate" in result.lines[2].detail
    assert result.lines[3].verdict == UNREADABLE
    assert result.lines[3].code == "PROVIDER_SCRIPT_UNREADABLE" and not result.ok
    # The end says the case blocks at that last line (not "first": earlier lines may block
    # too, a hostile trial read "first blocks at line 20" after 15 such lines; it said only
    # that call 5 finds no reply, after the line's "the case blocks here": a new user's
    # trial).
    assert result.end == (
        "the file ends after 4 reply line(s): the case blocks at its last line, 4 "
        "(PROVIDER_CONFIGURATION); once it is resumed, call 5 finds no reply and blocks the "
        "case (PROVIDER_CONFIGURATION, PROVIDER_SCRIPT_EXHAUSTED); add replies to continue"), \
        result.end
    # A last line rejected until the case blocks (INVALID_LLM_RESPONSES): the reason alone,
    # not half of the line's own note (a hostile trial read the resume advice twice).
    tiny_case.replies_path.write_text(first + "\n" + '{"bogus": true}\n' * 3)
    ends = check_script(tiny_case.store, tiny_case.case_id, tiny_case.replies_path).end
    assert ends.startswith("the file ends after 4 reply line(s): the case blocks at its "
                           "last line, 4 (INVALID_LLM_RESPONSES); once it is resumed, call 5 "
                           "finds no reply"), ends


def test_cli_replies_check(tiny_case: Case, tmp_path: Path,
                           monkeypatch: pytest.MonkeyPatch) -> None:
    from workers.cli import app

    monkeypatch.setenv("INVESTIGATE_DATABASE_URL", tiny_case.store.url)
    monkeypatch.setenv("INVESTIGATE_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("INVESTIGATE_CONFIG", raising=False)
    res = CliRunner().invoke(app, ["replies", "check", str(tiny_case.replies_path),
                                   tiny_case.case_id])
    assert res.exit_code == 0, res.output
    assert "the next call (1) reads reply line 1" in res.output
    assert "depends" in res.output and "SUPPORT_WITHOUT_FINDINGS" in res.output
    res = CliRunner().invoke(app, ["replies", "check", str(tiny_case.replies_path),
                                   tiny_case.case_id, "--json"])
    info = json.loads(res.stdout)
    assert info["counts"]["accepted"] == 3 and info["ok"] is True
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{}\n")
    res = CliRunner().invoke(app, ["replies", "check", str(bad), tiny_case.case_id])
    assert res.exit_code == 1 and "REPLY_SCHEMA_INVALID" in res.output
    res = CliRunner().invoke(app, ["replies", "check", str(tmp_path / "none.jsonl"),
                                   tiny_case.case_id])
    assert res.exit_code == 2 and "SCRIPT_UNREADABLE" in res.output
    # A reply written over several lines is said again after the table (a re-trial read
    # only the counts line at the end of a long table).
    pretty = tmp_path / "pretty.jsonl"
    pretty.write_text(json.dumps(casekit.HAPPY_REPLIES[0], indent=2) + "\n")
    res = CliRunner().invoke(app, ["replies", "check", str(pretty), tiny_case.case_id],
                             terminal_width=200)
    assert res.exit_code == 1
    assert res.output.rstrip().splitlines()[-1] == (
        "note: a reply is written over several lines from line 1 on: a reply file holds "
        "one reply per line")


def test_the_start_line_names_the_files_own_line_number() -> None:
    """Blank lines do not count as replies, so the reply the next call reads can sit
    further down than call + 1 (a review: the table showed file line numbers, the start
    line call numbers)."""
    from investigation.loop.script_check import _start

    lines = [(1, b"a"), (2, b"b"), (4, b"c"), (7, b"d")]  # blank lines 3, 5 and 6
    assert _start("INVESTIGATING", None, 2, 2, lines).endswith(
        "the next call (3) reads reply line 4")
    assert _start("BLOCKED", "INVALID_LLM_RESPONSES", 3, 3, lines).endswith(
        "call 4 reads reply line 7")
    assert _start("INVESTIGATING", None, 4, 4, lines).endswith(
        "reads reply line 8 (not written yet)")
    # Fewer reply lines than calls made: the next reply is the file's reply 501, not the
    # line after its last (a 500-step case's reader padded the file by hand after `run`
    # said so, while the check named line 4).
    assert _start("INVESTIGATING", None, 500, 500, lines).endswith(
        "the next call (501) reads the file's reply 501, past its end (it holds 4 reply "
        "line(s) for the 500 call(s) made: call N reads the N-th reply line, blank lines "
        "not counted)")


def test_cli_gathers_runs_of_served_and_unused_lines(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A reply file of many lines against a case that has read some and completes before
    the rest printed one row per line (15,000 lines: a 20,000-line table of the same
    sentence); runs of served and of unused lines are one row each, `--json` keeps all."""
    from workers.cli import app

    case = make_case(tmp_path / "case")
    assert case.investigator().run(case.case_id).outcome == "COMPLETED"
    served = len([line for line in case.replies_path.read_text().splitlines() if line])
    extra = json.dumps(casekit.HAPPY_REPLIES[0])
    with case.replies_path.open("a") as f:
        f.write((extra + "\n") * 500)
    monkeypatch.setenv("INVESTIGATE_DATABASE_URL", case.store.url)
    monkeypatch.setenv("INVESTIGATE_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("INVESTIGATE_CONFIG", raising=False)
    res = CliRunner().invoke(app, ["replies", "check", str(case.replies_path),
                                   case.case_id], terminal_width=200)
    assert res.exit_code == 0, res.output
    rows = [line for line in res.output.splitlines() if line.startswith("│")]
    assert len(rows) < 10, res.output
    cells = [[c.strip() for c in r.split("│")[1:-1]] for r in rows]
    assert cells[0][:2] == [f"1-{served}", f"1-{served}"] and cells[0][4] == "served"
    assert cells[0][5] == (f"calls 1-{served} were already made; the case will not read "
                           "these lines again")
    assert cells[1][0] == f"{served + 1}-{served + 500}" and cells[1][4] == "unused"
    assert "never read: the case is complete before" in cells[1][5]
    as_json = CliRunner().invoke(app, ["replies", "check", str(case.replies_path),
                                       case.case_id, "--json"])
    assert len(json.loads(as_json.stdout)["lines"]) == served + 500


def test_unused_lines_past_the_judged_ones_are_counted_not_listed(tmp_path: Path) -> None:
    """A 40 MB file of 20 million lines against a finished case took 8 GB as a list of
    lines and verdicts (a hostile-input trial): the lines past the served ones and
    MAX_JUDGED_LINES more are counted, named in the end line, and not kept."""
    from investigation.loop.script_check import MAX_JUDGED_LINES

    case = make_case(tmp_path / "case")
    assert case.investigator().run(case.case_id).outcome == COMPLETED
    served = len([line for line in case.replies_path.read_text().splitlines() if line])
    extra = MAX_JUDGED_LINES + 500
    with case.replies_path.open("a") as f:
        f.write("x\n" * extra)
    result = check_script(case.store, case.case_id, case.replies_path)
    assert len(result.lines) == served + MAX_JUDGED_LINES + 1
    assert result.unlisted_unused == extra - MAX_JUDGED_LINES - 1
    assert result.counts["unused"] == extra and result.ok
    assert result.end == (
        f"the case is already finished; the {extra - MAX_JUDGED_LINES - 1} reply line(s) "
        f"after line {result.lines[-1].line}, to line {served + extra}, are never read "
        "either (not listed one by one)")
    assert result.to_dict()["unlisted_unused"] == result.unlisted_unused


def test_a_served_line_with_a_note_is_not_gathered_into_a_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A garbage line inserted into a served file: `--json` named the shifted lines
    "edited since call N read it" while the table showed one clean `served` row."""
    from workers.cli import app

    case = make_case(tmp_path / "case")
    assert case.investigator().run(case.case_id).outcome == COMPLETED
    lines = case.replies_path.read_text().splitlines()
    lines.insert(2, "{}")
    shifted = tmp_path / "shifted.jsonl"
    shifted.write_text("\n".join(lines) + "\n")
    monkeypatch.setenv("INVESTIGATE_DATABASE_URL", case.store.url)
    monkeypatch.setenv("INVESTIGATE_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("INVESTIGATE_CONFIG", raising=False)
    res = CliRunner().invoke(app, ["replies", "check", str(shifted), case.case_id],
                             terminal_width=250)
    assert res.exit_code == 0, res.output
    noted = check_script(case.store, case.case_id, shifted)
    edited = [v.line for v in noted.lines if any("edited since" in n for n in v.notes)]
    assert edited and edited[0] == 3
    rows = [[c.strip() for c in r.split("│")[1:-1]]
            for r in res.output.splitlines() if r.startswith("│")]
    first_cells = [r[0] for r in rows if r[0]]
    assert first_cells[0] == "1-2" and "3" in first_cells, res.output
    assert "edited since call 3 read it" in " ".join(res.output.split())
