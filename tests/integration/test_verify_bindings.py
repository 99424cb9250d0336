"""``investigate verify`` and ``export`` check the records that bind the artifacts the
checkpoint chain does not hash (a hostile-input trial: with the store's guards dropped,
an artifact row pointed at other stored bytes left every artifact matching its own
sha256, and verify said "intact"). Seed 000, "Persistence and recovery": an accepted plan
is bound to its successful model call, saved request, context and exact output."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import update
from sqlmodel import col, select

from investigation import operations
from investigation.errors import InvestigationError
from investigation.store.models import Artifact, Evidence, LLMAttempt, Question
from tests.casekit import Case, unguarded

#: Artifact path endings, each swapped for another artifact's bytes in its own run.
SWAPPED = ["attempt-01.response", "attempt-01.request.json", "plan.json", "result.json"]


def _completed(tiny_case: Case) -> Case:
    investigator = tiny_case.investigator()
    for _ in range(5):
        investigator.step(tiny_case.case_id)
    return tiny_case


def test_an_intact_case_verifies_every_binding(tiny_case: Case) -> None:
    case = _completed(tiny_case)
    report = operations.verify(case.store, case.case_id)
    # 5 requests and responses, 5 plans, 3 query results.
    assert report["bindings"] == 5 * 2 + 5 + 3, report


@pytest.mark.parametrize("ending", SWAPPED)
def test_an_artifact_pointed_at_other_bytes_is_found(tiny_case: Case, ending: str,
                                                     tmp_path: Path) -> None:
    case = _completed(tiny_case)
    with case.store.session() as s:
        rows = s.exec(select(Artifact).where(Artifact.case_id == case.case_id)
                      .order_by(col(Artifact.path))).all()
        target = next(a for a in rows if a.path.endswith(ending))
        other = next(a for a in rows if a.path.endswith("context.json"))
    with unguarded(case.store), case.store.engine.begin() as conn:
        conn.execute(update(Artifact).where(col(Artifact.id) == target.id)
                     .values(sha256=other.sha256, size_bytes=other.size_bytes))
    with pytest.raises(InvestigationError) as err:
        operations.verify(case.store, case.case_id)
    assert err.value.code == "STATE_TAMPERED", err.value.message
    assert target.path in err.value.message or "not bound" in err.value.message
    with pytest.raises(InvestigationError) as refused:
        operations.export(case.store, case.case_id, tmp_path / "out")
    assert refused.value.code == "STATE_TAMPERED"
    assert not (tmp_path / "out").exists()


def test_a_plan_renamed_away_from_its_artifact_is_found(tiny_case: Case) -> None:
    case = _completed(tiny_case)
    with unguarded(case.store), case.store.engine.begin() as conn:
        conn.execute(update(Artifact).where(col(Artifact.case_id) == case.case_id,
                                            col(Artifact.path).like("%0002/plan.json"))
                     .values(path="../../../../escaped.json"))
    with pytest.raises(InvestigationError) as err:
        operations.verify(case.store, case.case_id)
    assert err.value.code == "STATE_TAMPERED" and "plan" in err.value.message


def test_an_intact_case_verifies_its_scores_questions_and_token_counts(
        tiny_case: Case) -> None:
    case = _completed(tiny_case)
    with case.store.session() as s:
        assessed = len(s.exec(select(Evidence).where(Evidence.case_id == case.case_id,
                                                     col(Evidence.assessed))).all())
        questions = len(s.exec(select(Question).where(Question.case_id == case.case_id)).all())
        answered = len(s.exec(select(LLMAttempt).where(LLMAttempt.status == "succeeded")).all())
    report = operations.verify(case.store, case.case_id)
    assert assessed and questions and answered == 5, (assessed, questions, answered)
    assert report["figures"] == assessed + questions + answered, report


#: A figure the read commands show and no checkpoint state holds, changed with the store's
#: guards dropped (a 500-step case's reader: verify said "intact" after each).
TAMPERED = {
    "score": (Evidence, "assessed", {"assessment_score": 3}, "assessment score is 3"),
    "question": (Question, None, {"text": "TAMPERED QUESTION"}, "question Q1"),
    "tokens": (LLMAttempt, None, {"prompt_tokens": 1_000_000}, "records 1000000 prompt"),
}


@pytest.mark.parametrize("figure", sorted(TAMPERED))
def test_a_changed_figure_is_found_by_verify_and_export(tiny_case: Case, figure: str,
                                                        tmp_path: Path) -> None:
    case = _completed(tiny_case)
    model, flag, values, said = TAMPERED[figure]
    with case.store.session() as s:
        query = select(model)
        if model is not LLMAttempt:
            query = query.where(model.case_id == case.case_id)  # type: ignore[attr-defined]
        if flag:
            query = query.where(col(getattr(model, flag)))
        row_id = s.exec(query.order_by(col(model.id))).first().id  # type: ignore[attr-defined,union-attr]
    with unguarded(case.store), case.store.engine.begin() as conn:
        conn.execute(update(model).where(col(model.id) == row_id)  # type: ignore[attr-defined]
                     .values(**values))
    with pytest.raises(InvestigationError) as err:
        operations.verify(case.store, case.case_id)
    assert err.value.code == "STATE_TAMPERED" and said in err.value.message, \
        err.value.message
    with pytest.raises(InvestigationError) as refused:
        operations.export(case.store, case.case_id, tmp_path / "out")
    assert refused.value.code == "STATE_TAMPERED"


def _forge(case: Case, sql: str) -> None:
    """Run ``sql`` on the store with its guards dropped (what DDL rights allow)."""
    from sqlalchemy import text

    with unguarded(case.store), case.store.engine.begin() as conn:
        for statement in sql.split(";"):
            if statement.strip():
                conn.execute(text(statement))


def _tampered(case: Case, said: str) -> None:
    with pytest.raises(InvestigationError) as err:
        operations.verify(case.store, case.case_id)
    assert err.value.code == "STATE_TAMPERED" and said in err.value.message, \
        err.value.message


#: A hostile trial's forgeries that verify called intact: counts on attempts that hold
#: none (no guard needed on llm_attempt before migration 0013), a second succeeded
#: attempt, a question moved off its published step.
FORGED = {
    "counts on a failed attempt": (
        "UPDATE llm_attempt SET status = 'failed', prompt_tokens = 777777 WHERE id = 1; "
        "UPDATE llm_operation SET status = 'failed' WHERE id = 1",
        "did not succeed (failed) yet records"),
    "an attempt added": (
        "INSERT INTO llm_attempt (operation_id, attempt, provider, request_path, "
        "request_sha256, status, started_at) SELECT operation_id, 2, provider, request_path, "
        "request_sha256, 'failed', started_at FROM llm_attempt WHERE id = 1",
        "model operation 1 records 1 attempt(s) but stores attempts [1, 2]"),
    "a succeeded attempt without its response": (
        "UPDATE llm_attempt SET response_path = NULL WHERE id = 1",
        "succeeded, but its response is not stored"),
    "two succeeded attempts": (
        "INSERT INTO llm_attempt (operation_id, attempt, provider, request_path, "
        "request_sha256, response_path, response_sha256, status, started_at) SELECT "
        "operation_id, 2, provider, request_path, request_sha256, response_path, "
        "response_sha256, 'succeeded', started_at FROM llm_attempt WHERE id = 1",
        "model operation 1 records 1 attempt(s) but stores attempts [1, 2]"),
    "a succeeded attempt turned into a failure": (
        "UPDATE llm_attempt SET status = 'failed' WHERE id = 1",
        "model operation 1 is succeeded with succeeded attempt(s) []"),
    "an attempt deleted": (
        "DELETE FROM llm_attempt WHERE id = 1",
        "not bound to the model call it names (operation 1, attempt 1)"),
    "an attempt of no known status": (
        "UPDATE llm_attempt SET status = 'weird' WHERE id = 2; UPDATE llm_operation SET "
        "status = 'pending' WHERE id = 2", "has the status 'weird', which no attempt has"),
    "a question resolved at another step": (
        "UPDATE question SET resolved_step = 2 WHERE question_id = 'Q1'",
        "question Q1 is resolved at step 2, not as the plans resolved it"),
    "a question resolved by other evidence": (
        "UPDATE question SET resolution_evidence_json = '[\"E2\"]' "
        "WHERE question_id = 'Q1'", "question Q1 is resolved at step 4, not as the plans"),
    "a question moved off its step": (
        "UPDATE question SET created_step = 99, text = 'forged' WHERE question_id = 'Q1'",
        "question Q1 (step 99) is not the question a plan asked"),
}


@pytest.mark.parametrize("forgery", sorted(FORGED))
def test_a_forged_figure_row_is_found(tiny_case: Case, forgery: str) -> None:
    case = _completed(tiny_case)
    sql, said = FORGED[forgery]
    _forge(case, sql)
    _tampered(case, said)


def test_a_record_scored_while_a_step_is_unpublished_is_found(tmp_path: Path) -> None:
    """The evidence guard lets an unassessed record be assessed: on a blocked case verify
    skipped the live rows and the figures went only from plan to record, so any score
    passed (a hostile trial). A record no plan assessed must not be assessed."""
    from tests import casekit
    from tests.casekit import make_case

    case = make_case(tmp_path / "c", replies=casekit.HAPPY_REPLIES[:2])
    outcome = case.investigator().run(case.case_id, max_steps=10)
    assert outcome.reason == "PROVIDER_CONFIGURATION", outcome  # step 3 halted mid-way
    report = operations.verify(case.store, case.case_id)
    assert (report["live_rows"], report["figures"]) == ("step 3 in progress", 3), report
    with case.store.engine.begin() as conn:  # the guards let this through
        conn.execute(update(Evidence).where(col(Evidence.evidence_id) == "E2")
                     .values(assessed=True, assessment_score=99))
    _tampered(case, "evidence E2 is assessed (score 99), but no plan assessed it")


@pytest.mark.parametrize("score", ["1e400", "-Infinity", "[" * 5000 + "]" * 5000, "80.5",
                                   "true", '"80"', "101"])
def test_a_plan_document_of_the_wrong_shape_is_tampered_not_a_crash(
        tiny_case: Case, score: str) -> None:
    """A plan whose score is infinite or nested 5,000 deep ended verify and export with an
    internal error (exit 5); one whose score was "80", 80.9 or true passed (a hostile
    trial). The plan's bytes and its sha256 are replaced together, as DDL rights allow."""
    import hashlib

    from investigation.store.engine import Store
    from investigation.store.models import Plan

    case = _completed(tiny_case)
    with case.store.session() as s:
        plan = s.exec(select(Plan).where(Plan.step_seq == 3)).one()
        art = Store.get_artifact(s, case.case_id, plan.plan_path)
        assert art is not None
    data = art.data.replace(b'"score":90', b'"score":' + score.encode())
    assert data != art.data
    digest = hashlib.sha256(data).hexdigest()
    _forge(case, f"DELETE FROM artifact WHERE path = '{plan.plan_path}'")
    with unguarded(case.store):
        with case.store.session() as s:
            Store.put_artifact(s, case.case_id, plan.plan_path, data)
        _forge(case, f"UPDATE plan SET plan_sha256 = '{digest}' WHERE id = {plan.id}")
    _tampered(case, "the plan of step 3 (revision 1)")


def test_export_checks_the_live_rows_as_verify_does(tiny_case: Case, tmp_path: Path) -> None:
    """A question reopened with the guards dropped: verify refused the case and export
    wrote it (export read no live row; a hostile trial)."""
    case = _completed(tiny_case)
    _forge(case, "UPDATE question SET status = 'open', resolved_step = NULL "
                 "WHERE question_id = 'Q1'")
    _tampered(case, "the questions differ from checkpoint 5")
    with pytest.raises(InvestigationError) as refused:
        operations.export(case.store, case.case_id, tmp_path / "out")
    assert refused.value.code == "STATE_TAMPERED" and "questions" in refused.value.message
    assert not (tmp_path / "out").exists()
