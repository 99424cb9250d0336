"""The Investigator: ``step`` and ``run`` over the eight stages (seed 000, "API and dispatch").

``step`` processes at most one model decision and its confirmed local execution by
calling the stages in order; ``run`` repeats eligible steps up to
``max_steps_per_dispatch`` (or an explicit ``max_steps``) and then returns ``YIELDED``.
The Celery runtime calls the very same ``Stages.run`` from one task per stage.
"""

from __future__ import annotations

from sqlalchemy import bindparam
from sqlalchemy import select as sa_select

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
from investigation.store.engine import table_of
from investigation.store.models import CaseRecord, RevisionRecord

# Built once (building a statement costs more than running it on SQLite). The case's
# scheduling columns and whether its current revision exists, in one Core query (no ORM
# object: nothing here is changed).
_CASE = table_of(CaseRecord).c
_REV = table_of(RevisionRecord).c
_NEXT_STEP = sa_select(
    _CASE.state, _CASE.current_revision, _CASE.head_seq, _CASE.blocked_reason,
    sa_select(_REV.id).where(_REV.case_id == _CASE.id,
                             _REV.revision == _CASE.current_revision)
    .limit(1).scalar_subquery()).where(_CASE.id == bindparam("case_id"))


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
        row = self.env.store.read_one(_NEXT_STEP, {"case_id": case_id})
        if row is None:
            raise InvestigationError("CASE_NOT_FOUND",
                                     f"no case {case_id}; register it with `case add`")
        state, current_revision, head_seq, blocked_reason, rev = row
        if rev is None:
            raise InvestigationError(
                "REVISION_NOT_ACCEPTED",
                f"case {case_id} revision {current_revision} has no accepted "
                "interpretation and hypotheses")
        if state == CASE_BUILDING_DIAGNOSIS:
            return Outcome(COMPLETED, case_id, head_seq, "ALL_ACCOUNTS_TERMINAL")
        if state == CASE_BLOCKED:
            return Outcome(BLOCKED, case_id, head_seq, blocked_reason)
        if state in (*CASE_HELD, CASE_STOPPED):
            return Outcome(BLOCKED, case_id, head_seq,
                           state if state != CASE_STOPPED else blocked_reason)
        return StepKey(case_id, current_revision, head_seq + 1)

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
