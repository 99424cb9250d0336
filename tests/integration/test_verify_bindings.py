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
    report = operations.verify(case.store, case.case_id)
    assert assessed and questions, (assessed, questions)
    assert report["figures"] == assessed + questions, report


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
