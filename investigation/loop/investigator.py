"""The Investigator: ``step`` and ``run`` over the eight stages (seed 000, "API and dispatch").

``step`` processes at most one model decision and its confirmed local execution by
calling the stages in order; ``run`` repeats eligible steps up to
``max_steps_per_dispatch`` (or an explicit ``max_steps``) and then returns ``YIELDED``.
The Celery runtime calls the very same ``Stages.run`` from one task per stage.
"""

from __future__ import annotations

from sqlalchemy import bindparam
from sqlmodel import col, select

from investigation.constants import (
    BLOCKED,
    CASE_BLOCKED,
    CASE_BUILDING_DIAGNOSIS,
    CASE_HELD,
    CASE_STOPPED,
    COMPLETED,
    CONTINUING,
    STAGES,
    YIELDED,
)
from investigation.errors import InvestigationError
from investigation.loop.env import StageEnv
from investigation.loop.outcome import Outcome, StepKey
from investigation.loop.stages import Stages
from investigation.store.models import CaseRecord, RevisionRecord

# Built once (building a statement costs more than running it on SQLite).
_REVISION_ACCEPTED = select(col(RevisionRecord.id)).where(
    col(RevisionRecord.case_id) == bindparam("case_id"),
    col(RevisionRecord.revision) == bindparam("revision"))


class Investigator:
    """In-process driver of the stage chain.

    Args:
        env: store, config, gateway factory and package reader.
    """

    def __init__(self, env: StageEnv) -> None:
        self.env = env
        self.stages = Stages(env)

    def next_step(self, case_id: str) -> StepKey | Outcome:
        """The key of the case's next step, or the outcome that says there is none.

        Raises:
            InvestigationError: ``CASE_NOT_FOUND``; ``REVISION_NOT_ACCEPTED`` when the
            current revision lacks an accepted interpretation/hypothesis batch.
        """
        with self.env.store.session() as s:
            case = s.get(CaseRecord, case_id)
            if case is None:
                raise InvestigationError("CASE_NOT_FOUND",
                                         f"no case {case_id}; register it with `case add`")
            rev = s.exec(_REVISION_ACCEPTED, params={
                "case_id": case_id, "revision": case.current_revision}).first()
            if rev is None:
                raise InvestigationError(
                    "REVISION_NOT_ACCEPTED",
                    f"case {case_id} revision {case.current_revision} has no accepted "
                    "interpretation and hypotheses")
            if case.state == CASE_BUILDING_DIAGNOSIS:
                return Outcome(COMPLETED, case_id, case.head_seq, "ALL_ACCOUNTS_TERMINAL")
            if case.state == CASE_BLOCKED:
                return Outcome(BLOCKED, case_id, case.head_seq, case.blocked_reason)
            if case.state in (*CASE_HELD, CASE_STOPPED):
                return Outcome(BLOCKED, case_id, case.head_seq,
                               case.state if case.state != CASE_STOPPED
                               else case.blocked_reason)
            return StepKey(case_id, case.current_revision, case.head_seq + 1)

    def step(self, case_id: str) -> Outcome:
        """Run one step: every stage in order until one ends the step.

        Returns:
            ``PROGRESSED``, ``REJECTED``, ``RETRY_PENDING``, ``BLOCKED`` or ``COMPLETED``.
        """
        key = self.next_step(case_id)
        if isinstance(key, Outcome):
            return key
        for stage in STAGES:
            result = self.stages.run(stage, key)
            if result.halt is not None:
                return result.halt
        raise InvestigationError("STAGE_ORDER", f"step {key.step_seq} ended without publish")

    def run(self, case_id: str, max_steps: int | None = None) -> Outcome:
        """Repeat :meth:`step` while it progresses, at most ``max_steps`` times
        (default: the frozen ``max_steps_per_dispatch``); then ``YIELDED``."""
        limit = max_steps if max_steps is not None else \
            self.env.config.loop.max_steps_per_dispatch
        last: Outcome | None = None
        for _ in range(limit):
            last = self.step(case_id)
            if last.outcome not in CONTINUING:
                return last
        assert last is not None
        return Outcome(YIELDED, case_id, last.step_seq, "MAX_STEPS_PER_DISPATCH",
                       hypothesis_id=last.hypothesis_id)
