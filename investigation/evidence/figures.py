"""What a revision's evidence records amount to, in figures and in words.

``run``, ``status``, the report's overview and ``summary.md`` (per hypothesis, where some
record found nothing new) say it alike: how many records found new items, how many found
nothing new and how many of those repeat an earlier record, and the lowest, median and
highest assessment score (seed 000's 0-100 score of a result).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping
from typing import Any


def evidence_figures(records: Iterable[Mapping[str, Any]]) -> dict[str, int | float | None]:
    """What the evidence records of a revision amount to: a real model's run of
    duplicate listings, each scored 0, ended COMPLETED and read as a success (a trial).

    Args:
        records: each with ``duplicate`` (bool), ``new_item_count`` (int), ``assessed``
            (bool) and ``assessment_score`` (0-100 or ``None``).

    Returns:
        ``{"records", "duplicate", "no_new_item", "assessed", "score_lowest",
        "score_median", "score_highest"}``: counts, and the assessment scores (seed 000's
        0-100 score of a result) of the assessed records (``None`` when none is)."""
    records = list(records)
    scores = sorted(int(r["assessment_score"]) for r in records
                    if r["assessed"] and r["assessment_score"] is not None)
    return {"records": len(records),
            "duplicate": sum(1 for r in records if r["duplicate"]),
            "no_new_item": sum(1 for r in records if not r["new_item_count"]),
            "assessed": len(scores),
            "score_lowest": scores[0] if scores else None,
            "score_median": _median(scores) if scores else None,
            "score_highest": scores[-1] if scores else None}


def _median(scores: list[int]) -> int | float:
    """The middle score, or the mean of the two middle ones (an int when whole): with two
    scores, 80 and 95, "median 95" was the upper one (a re-trial)."""
    middle = statistics.median(scores)
    return int(middle) if float(middle).is_integer() else float(middle)


def records_text(fig: Mapping[str, int | float | None]) -> str:
    """``"6: 3 found new items, 3 found nothing new (2 duplicates of earlier records)"``,
    or ``"0"``. (A duplicate finds nothing new; "3 duplicate, 3 with no new item" read as
    six useless records out of six, a real model's user; "found none" read as empty
    results where most had returned rows seen before, an engineer reading a long case.)"""
    records, none, dup = fig["records"] or 0, fig["no_new_item"] or 0, fig["duplicate"] or 0
    if not records:
        return "0"
    text = f"{records}: {records - none} found new items, {none} found nothing new"
    return text + (f" ({dup} duplicate{'s' if dup != 1 else ''} of earlier records)"
                   if dup else "")


def scores_text(fig: Mapping[str, int | float | None]) -> str:
    """``"8 assessed: lowest 40, median 85, highest 95"``, or ``"none assessed yet"``."""
    if not fig["assessed"]:
        return "none assessed yet"
    return (f"{fig['assessed']} assessed: lowest {fig['score_lowest']}, median "
            f"{fig['score_median']}, highest {fig['score_highest']}")


def evidence_text(fig: Mapping[str, int | float | None]) -> str:
    """The line ``run`` and ``status`` print: ``"evidence records ...; assessment scores
    ..."`` (:func:`records_text`, :func:`scores_text`)."""
    return f"evidence records {records_text(fig)}; assessment scores {scores_text(fig)}"
