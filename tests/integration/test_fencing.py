"""Fencing without the lock: runners racing on one case produce every effect once.

The Redis lock only prevents wasted work; correctness rests on the stage markers and the
compare-and-set of the checkpoint head. Here several threads run steps of the same case
at the same time with no lock at all; the result must equal an uninterrupted run.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from investigation.constants import COMPLETED
from investigation.errors import StaleStateError
from investigation.loop.investigator import Investigator
from tests.casekit import make_case
from tests.integration.test_interrupts import fingerprint


def _race(case: Any, runners: int) -> list[str]:
    stale: list[str] = []
    done = threading.Event()
    errors: list[BaseException] = []

    def runner() -> None:
        inv = Investigator(case.env())
        try:
            for _ in range(200):
                if done.is_set():
                    return
                try:
                    outcome = inv.step(case.case_id)
                except StaleStateError as exc:
                    stale.append(exc.code)
                    continue
                if outcome.outcome == COMPLETED:
                    done.set()
                    return
        except BaseException as exc:  # surfaced below
            errors.append(exc)
            done.set()

    threads = [threading.Thread(target=runner) for _ in range(runners)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert done.is_set()
    return stale


@pytest.mark.parametrize("backend", [
    "sqlite",
    pytest.param("postgres", marks=pytest.mark.postgres),
    # A server whose default isolation is SERIALIZABLE: racing transactions fail with
    # serialization failures, which must end like a lost unique race (re-read or rerun).
    pytest.param("postgres-serializable", marks=pytest.mark.postgres),
])
def test_racing_runners_produce_each_effect_once(backend: str, tmp_path: Path,
                                                 request: pytest.FixtureRequest) -> None:
    url = request.getfixturevalue("postgres_url") if backend != "sqlite" else None
    if backend == "postgres-serializable":
        url = f"{url}%20-cdefault_transaction_isolation%3Dserializable"
    reference = make_case(tmp_path / "ref")
    assert reference.investigator().run(reference.case_id, max_steps=50).outcome == COMPLETED
    raced = make_case(tmp_path / "raced", database_url=url)
    _race(raced, runners=4)
    expected = fingerprint(reference)
    got = fingerprint(raced)
    assert got == expected
