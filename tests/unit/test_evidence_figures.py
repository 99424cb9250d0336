"""``evidence.figures``: what a revision's evidence records amount to."""

from __future__ import annotations

from investigation.evidence.figures import evidence_figures, records_text, scores_text


def _record(duplicate: bool, new: int, score: int | None) -> dict[str, object]:
    return {"duplicate": duplicate, "new_item_count": new, "assessed": score is not None,
            "assessment_score": score}


def test_a_worthless_run_shows_in_its_figures() -> None:
    """Nine listings, eight of them duplicates, each scored 0: the figures say so."""
    records = [_record(False, 4, 0)] + [_record(True, 0, 0) for _ in range(7)] + \
        [_record(True, 0, None)]
    fig = evidence_figures(records)
    assert fig == {"records": 9, "duplicate": 8, "no_new_item": 8, "assessed": 8,
                   "score_lowest": 0, "score_median": 0, "score_highest": 0}
    assert records_text(fig) == "9: 1 found new items, 8 found nothing new (8 duplicates of " \
        "earlier records)"
    assert records_text(evidence_figures([_record(False, 2, 50), _record(True, 0, 0)])) == \
        "2: 1 found new items, 1 found nothing new (1 duplicate of earlier records)"
    assert records_text(evidence_figures([_record(False, 2, 50)])) == \
        "1: 1 found new items, 0 found nothing new"
    assert scores_text(fig) == "8 assessed: lowest 0, median 0, highest 0"


def test_no_records_and_none_assessed() -> None:
    assert records_text(evidence_figures([])) == "0"
    fig = evidence_figures([_record(False, 2, None)])
    assert (fig["assessed"], fig["score_median"]) == (0, None)
    assert scores_text(fig) == "none assessed yet"


def test_the_median_of_an_even_count_is_the_mean_of_the_middle_two() -> None:
    """(80, 95) read "median 95" (a re-trial)."""
    fig = evidence_figures([_record(False, 1, s) for s in (95, 40, 85, 60)])
    assert (fig["score_lowest"], fig["score_median"], fig["score_highest"]) == (40, 72.5, 95)
    assert scores_text(evidence_figures([_record(False, 1, 80), _record(False, 1, 95)])) == \
        "2 assessed: lowest 80, median 87.5, highest 95"
    odd = evidence_figures([_record(False, 1, s) for s in (10, 30, 20)])
    assert odd["score_median"] == 20 and isinstance(odd["score_median"], int)
