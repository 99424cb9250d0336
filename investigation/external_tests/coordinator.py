"""AsyncTestCoordinator: external tests with authenticated, confirmed feedback (seed 000,
"Provider failures and external tests"; the design is ``docs/async-tests.md``).

A ``test`` next-action hands a descriptor to a human or an automated rig. The controller
freezes a deadline (``loop.test_deadline_seconds``), reserves the configured credit,
stores the exact request and blocks the case ``AWAITING_TEST_FEEDBACK``; no worker waits
and no time-based charge is made. Feedback arrives in two steps:

1. ``submit``: the feedback and the request's secret. The secret is
   ``HMAC-SHA256(feedback key, case id, request id)``; only its sha256 is stored and the
   comparison is constant-time. The submission is stored with its sha256 (the *digest*).
2. ``confirm``: the same secret and the digest of what was submitted. Confirmation
   imports the feedback as evidence of the hypothesis (its pending result, assessed by
   the next model turn) and puts the case back to ``INVESTIGATING`` on the same revision.

A request whose deadline passes first is expired by :meth:`AsyncTestCoordinator.expire_due`
(run by the recovery sweep): it is recorded as an empty result with the warning
``TEST_DEADLINE_PASSED`` and the case continues the same way.

Refusals (``InvestigationError`` codes; none changes anything): ``CASE_NOT_FOUND``,
``TEST_REQUEST_NOT_FOUND``,
``FEEDBACK_FORGED`` (wrong secret: forged, or meant for another case or request),
``FEEDBACK_REPLAYED`` (already submitted, confirmed or expired), ``FEEDBACK_AFTER_DEADLINE``,
``FEEDBACK_NOT_SUBMITTED``, ``FEEDBACK_DIGEST_MISMATCH``, ``FEEDBACK_INVALID``,
``FEEDBACK_KEY_MISSING``, ``CASE_CANCELLED``, ``TEST_REQUEST_NOT_PUBLISHED`` (confirm
while the hand-off step is still being published).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError
from sqlalchemy import func, update
from sqlmodel import Session, col, select

from investigation import jsonio
from investigation.config import canonical_json
from investigation.constants import (
    ARTIFACT_TEST_REQUEST,
    BLOCK_AWAITING_TEST_FEEDBACK,
    CASE_BLOCKED,
    CASE_CANCELLED,
    CASE_INVESTIGATING,
)
from investigation.errors import InvestigationError
from investigation.evidence import EvidenceStore
from investigation.loop import lifecycle
from investigation.loop.contract import printable
from investigation.secrets import default_masker
from investigation.store.engine import Store, sha256_hex
from investigation.store.models import BudgetAccount, CaseRecord, TestRequest, utcnow
from investigation.tools.models import SECRET_MASKED

log = logging.getLogger(__name__)

#: Operation name of evidence imported from external tests.
FEEDBACK_OPERATION = "test.feedback"
#: Warning of a test whose deadline passed without confirmed feedback.
DEADLINE_WARNING = "TEST_DEADLINE_PASSED"
_SECRET_LABEL = b"investigation-test-feedback/v1"


def _aware(value: datetime) -> datetime:
    """SQLite returns naive datetimes; every stored time is UTC."""
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)


def _observation(value: str) -> str:
    """Printable text (the reply contract's rule: no control or bidi characters) that is
    not only whitespace."""
    printable(value)
    if not value.strip():
        raise ValueError("the observation is empty")
    return value


class Feedback(BaseModel):
    """What a human or rig reports for one test request.

    Attributes:
        outcome: ``as_expected``, ``not_as_expected`` or ``inconclusive``, compared with
            the request's ``expected_observation``.
        observation: what was observed, 1..8,000 printable characters (untrusted data).
    """

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)
    outcome: Literal["as_expected", "not_as_expected", "inconclusive"]
    observation: Annotated[str, Field(min_length=1, max_length=8000),
                           AfterValidator(_observation)]

    def canonical(self) -> bytes:
        """Canonical JSON bytes (their sha256 is the submission's digest)."""
        return canonical_json(self.model_dump(mode="json"))


def derive_secret(key: bytes, case_id: str, request_id: str) -> str:
    """The per-request feedback secret: hex ``HMAC-SHA256(key, label|case|request)``."""
    msg = b"\0".join([_SECRET_LABEL, case_id.encode(), request_id.encode()])
    return hmac.new(key, msg, hashlib.sha256).hexdigest()


def _secret_hash(secret: str) -> str:
    return sha256_hex(secret.encode("utf-8", "surrogatepass"))


def _authenticates(secret: str, r: TestRequest) -> bool:
    """Whether ``secret`` is ``r``'s (constant-time comparison of the hashes)."""
    return hmac.compare_digest(_secret_hash(secret).encode(), r.secret_sha256.encode())


def _texts(**values: object) -> None:
    """Refuse ids, a secret or a digest that are not text (``FEEDBACK_INVALID``): from
    Python, ``None`` or bytes ended in AttributeError and a list in the store's
    ProgrammingError (a hostile upstream trial)."""
    for name, value in values.items():
        if not isinstance(value, str):
            raise InvestigationError("FEEDBACK_INVALID",
                                     f"{name} must be text, not {type(value).__name__}")


class AsyncTestCoordinator:
    """Hands tests out and takes their feedback back (see the module docstring).

    Args:
        store: the SQL store.
        key: the feedback key (``INVESTIGATE_FEEDBACK_KEY`` or the key file); needed to
            hand a test out and to derive a request's secret, not to check one.
        clock: the time source (UTC, timezone-aware); tests pass a fixed clock.
    """

    def __init__(self, store: Store, key: bytes | None = None,
                 clock: Callable[[], datetime] = utcnow) -> None:
        self.store = store
        self.key = key
        self.clock = clock

    # -- the hand-off (inside the execute_tool transaction) -------------------------------

    def hand_off(self, s: Session, *, case_id: str, revision: int, step_seq: int,
                 hypothesis_id: int, test: dict[str, Any], cost_units: int,
                 deadline_seconds: int) -> TestRequest:
        """Store the exact request with its frozen deadline; idempotent per step.

        Args:
            test: the validated descriptor (``kind``, ``title``, ``instructions``,
                ``expected_observation``).
            cost_units: the credit reserved for it.
            deadline_seconds: the frozen ``loop.test_deadline_seconds``.

        Raises:
            InvestigationError: ``FEEDBACK_KEY_MISSING`` without a feedback key.
        """
        existing = s.exec(select(TestRequest).where(
            TestRequest.case_id == case_id, TestRequest.revision == revision,
            TestRequest.step_seq == step_seq)).first()
        if existing is not None:
            return existing
        if self.key is None:
            raise InvestigationError("FEEDBACK_KEY_MISSING",
                                     "no feedback key is configured; set "
                                     "INVESTIGATE_FEEDBACK_KEY or the key file")
        count = s.exec(select(func.count()).select_from(TestRequest).where(
            TestRequest.case_id == case_id)).one()
        request_id = f"T{int(count) + 1}"
        created = self.clock()
        deadline = created + timedelta(seconds=deadline_seconds)
        request = {
            "case_id": case_id, "revision": revision, "step_seq": step_seq,
            "request_id": request_id, "hypothesis_id": hypothesis_id, "test": test,
            "cost_units": cost_units, "deadline_at": deadline.isoformat(),
        }
        path = ARTIFACT_TEST_REQUEST.format(seq=step_seq)
        digest = Store.put_artifact(s, case_id, path, canonical_json(request))
        row = TestRequest(
            case_id=case_id, revision=revision, step_seq=step_seq,
            hypothesis_id=hypothesis_id, request_id=request_id, kind=str(test["kind"]),
            cost_units=cost_units, artifact_path=path, request_sha256=digest,
            secret_sha256=_secret_hash(derive_secret(self.key, case_id, request_id)),
            deadline_at=deadline, created_at=created)
        s.add(row)
        s.flush()
        return row

    # -- reading -------------------------------------------------------------------------

    def list_requests(self, case_id: str) -> list[dict[str, Any]]:
        """Every test request of a case, oldest first (see :meth:`show` for the shape).

        Raises:
            InvestigationError: ``CASE_NOT_FOUND`` (an unknown case listed as one that
                handed out no test hid a mistyped id).
        """
        with self.store.session() as s:
            rows = s.exec(select(TestRequest).where(TestRequest.case_id == case_id)
                          .order_by(col(TestRequest.id))).all()
            if not rows and s.get(CaseRecord, case_id) is None:
                raise InvestigationError("CASE_NOT_FOUND", f"no case {case_id}")
            return [self._describe(s, r) for r in rows]

    def show(self, case_id: str, request_id: str) -> dict[str, Any]:
        """One request: ids, status, kind, cost, deadline, the exact ``request`` document,
        and the submitted ``feedback`` and its digest once there.

        Raises:
            InvestigationError: ``TEST_REQUEST_NOT_FOUND``.
        """
        with self.store.session() as s:
            return self._describe(s, self._request(s, case_id, request_id))

    def secret(self, case_id: str, request_id: str) -> str:
        """The request's feedback secret, derived from the feedback key.

        Raises:
            InvestigationError: ``FEEDBACK_KEY_MISSING``, ``TEST_REQUEST_NOT_FOUND``,
                ``FEEDBACK_KEY_MISMATCH`` (this key is not the one the request was handed
                out with: the secret it derives would be refused, so none is given).
        """
        if self.key is None:
            raise InvestigationError("FEEDBACK_KEY_MISSING", "no feedback key is configured")
        with self.store.session() as s:
            row = self._request(s, case_id, request_id)
        if not self._handed_out_with_this_key(row):
            raise InvestigationError(
                "FEEDBACK_KEY_MISMATCH",
                f"the feedback key here is not the one {request_id} of {case_id} was handed "
                f"out with, so its secret would be refused; use the workers' key: the same "
                f"INVESTIGATE_HOME (its feedback.key) or INVESTIGATE_FEEDBACK_KEY")
        return derive_secret(self.key, case_id, request_id)

    def _handed_out_with_this_key(self, r: TestRequest) -> bool:
        """Whether this coordinator's key derives the secret ``r`` stores the hash of."""
        return self.key is not None and _authenticates(
            derive_secret(self.key, r.case_id, r.request_id), r)

    @staticmethod
    def _describe(s: Session, r: TestRequest) -> dict[str, Any]:
        art = Store.get_artifact(s, r.case_id, r.artifact_path)
        return {
            "case_id": r.case_id, "request_id": r.request_id, "revision": r.revision,
            "step_seq": r.step_seq, "hypothesis_id": r.hypothesis_id, "kind": r.kind,
            "status": r.status, "cost_units": r.cost_units,
            "deadline_at": _aware(r.deadline_at).isoformat(),
            "request": jsonio.loads(art.data) if art is not None else None,
            "request_sha256": r.request_sha256,
            "feedback": jsonio.loads(r.feedback_json) if r.feedback_json else None,
            "feedback_sha256": r.feedback_sha256, "evidence_id": r.evidence_id,
        }

    @staticmethod
    def _request(s: Session, case_id: str, request_id: str) -> TestRequest:
        row = s.exec(select(TestRequest).where(TestRequest.case_id == case_id,
                                               TestRequest.request_id == request_id)).first()
        if row is None:
            if s.get(CaseRecord, case_id) is None:  # not a case at all: say that
                raise InvestigationError("CASE_NOT_FOUND", f"no case {case_id}")
            raise InvestigationError("TEST_REQUEST_NOT_FOUND",
                                     f"case {case_id} has no test request {request_id!r}")
        return row

    def _authenticate(self, r: TestRequest, secret: str) -> None:
        if not _authenticates(secret, r):
            hint = ""
            if self.key is not None and not self._handed_out_with_this_key(r):
                # The operator's own key would not have handed this request out either: a
                # secret shown by a CLI with another INVESTIGATE_HOME than the workers'.
                hint = ("; the feedback key here is not the one the request was handed out "
                        "with either: a secret from `tests show --secret` is only right with "
                        "the workers' INVESTIGATE_HOME (its feedback.key) or "
                        "INVESTIGATE_FEEDBACK_KEY")
            raise InvestigationError(
                "FEEDBACK_FORGED",
                f"the secret does not authenticate feedback for {r.request_id} of "
                f"{r.case_id}{hint}")

    def _before_deadline(self, r: TestRequest) -> None:
        if self.clock() >= _aware(r.deadline_at):
            raise InvestigationError(
                "FEEDBACK_AFTER_DEADLINE",
                f"the deadline of {r.request_id} passed at "
                f"{_aware(r.deadline_at).isoformat()}; it is recorded without feedback")

    # -- feedback ------------------------------------------------------------------------

    def submit(self, case_id: str, request_id: str, secret: str,
               feedback: Feedback | dict[str, Any]) -> dict[str, Any]:
        """Step 1: store authenticated feedback; returns ``{"request_id", "status",
        "feedback_sha256"}`` (confirm with that digest).

        Raises:
            InvestigationError: ``TEST_REQUEST_NOT_FOUND``, ``FEEDBACK_FORGED``,
            ``FEEDBACK_REPLAYED``, ``FEEDBACK_AFTER_DEADLINE``, ``FEEDBACK_INVALID`` (also
            for an id or secret that is not text).
        """
        _texts(case_id=case_id, request_id=request_id, secret=secret)
        try:
            fb = feedback if isinstance(feedback, Feedback) else \
                Feedback.model_validate(feedback)
            data = fb.canonical()
        except ValidationError as exc:
            first = exc.errors(include_input=False)[0]
            where = ".".join(str(p) for p in first["loc"]) or "feedback"
            raise InvestigationError("FEEDBACK_INVALID",
                                     f"{where}: {first['msg']}"[:300]) from exc
        with self.store.session() as s:
            case = s.get(CaseRecord, case_id)
            if case is not None and case.state == CASE_CANCELLED:
                raise InvestigationError("CASE_CANCELLED",
                                         f"case {case_id} was cancelled; it takes no feedback")
            r = self._request(s, case_id, request_id)
            self._authenticate(r, secret)
            if r.status != "awaiting":
                raise InvestigationError("FEEDBACK_REPLAYED",
                                         f"{request_id} is already {r.status}")
            self._before_deadline(r)
            digest = sha256_hex(data)
            res = s.execute(update(TestRequest).where(
                col(TestRequest.id) == r.id, col(TestRequest.status) == "awaiting").values(
                status="submitted", feedback_json=data.decode("utf-8"), feedback_sha256=digest,
                submitted_at=self.clock()))
            if res.rowcount != 1:  # type: ignore[attr-defined]
                raise InvestigationError("FEEDBACK_REPLAYED",
                                         f"{request_id} was submitted concurrently")
        return {"request_id": request_id, "status": "submitted", "feedback_sha256": digest}

    def confirm(self, case_id: str, request_id: str, secret: str,
                feedback_sha256: str) -> dict[str, Any]:
        """Step 2: confirm the submission; import it as evidence and resume the case.

        Returns:
            ``{"request_id", "status": "confirmed", "evidence_id", "case_state"}``.

        Raises:
            InvestigationError: ``TEST_REQUEST_NOT_FOUND``, ``FEEDBACK_FORGED``,
            ``FEEDBACK_NOT_SUBMITTED``, ``FEEDBACK_REPLAYED``, ``FEEDBACK_DIGEST_MISMATCH``,
            ``FEEDBACK_AFTER_DEADLINE``; ``FEEDBACK_INVALID`` for an id, secret or digest
            that is not text.
        """
        _texts(case_id=case_id, request_id=request_id, secret=secret,
               feedback_sha256=feedback_sha256)
        with self.store.session() as s:
            case = self._lock_case(s, case_id)
            r = self._request(s, case_id, request_id)
            self._authenticate(r, secret)
            if r.status == "awaiting":
                raise InvestigationError("FEEDBACK_NOT_SUBMITTED",
                                         f"{request_id} has no submitted feedback to confirm")
            if r.status != "submitted":
                raise InvestigationError("FEEDBACK_REPLAYED",
                                         f"{request_id} is already {r.status}")
            if not hmac.compare_digest(feedback_sha256.encode(),
                                       (r.feedback_sha256 or "").encode()):
                raise InvestigationError("FEEDBACK_DIGEST_MISMATCH",
                                         "the digest does not match the submitted feedback")
            self._before_deadline(r)
            self._published(case, r)
            fb = jsonio.loads(r.feedback_json or "{}")
            items = [{"key": f"{r.request_id}:outcome", "text": fb["outcome"]},
                     {"key": f"{r.request_id}:observation", "text": fb["observation"]}]
            evidence_id = self._close(s, case, r, "confirmed", items, [],
                                      "TEST_FEEDBACK_CONFIRMED")
            state = case.state
        return {"request_id": request_id, "status": "confirmed", "evidence_id": evidence_id,
                "case_state": state}

    def expire_due(self, now: datetime | None = None) -> list[dict[str, Any]]:
        """Record every open request whose deadline passed as a result without feedback.

        Returns:
            ``[{"case_id", "request_id", "evidence_id"}]`` of the requests expired now.
        """
        now = now or self.clock()
        with self.store.session() as s:
            due = [(r.case_id, r.request_id) for r in s.exec(select(TestRequest).where(
                col(TestRequest.status).in_(("awaiting", "submitted")))).all()
                if _aware(r.deadline_at) <= now]
        expired: list[dict[str, Any]] = []
        for case_id, request_id in due:
            try:
                with self.store.session() as s:
                    case = self._lock_case(s, case_id)
                    r = self._request(s, case_id, request_id)
                    if r.status not in ("awaiting", "submitted") \
                            or case.head_seq < r.step_seq:
                        continue  # closed meanwhile, or its hand-off not yet published
                    eid = self._close(s, case, r, "expired", [], [DEADLINE_WARNING],
                                      DEADLINE_WARNING)
            except InvestigationError as exc:
                # Cancelled, or confirmed by a racing submit/confirm: leave it; one
                # request never stops the others' expiry (nor the recovery sweep).
                log.info("test %s of %s not expired: %s", request_id, case_id, exc.code)
                continue
            expired.append({"case_id": case_id, "request_id": request_id,
                            "evidence_id": eid})
        return expired

    # -- internals -----------------------------------------------------------------------

    @staticmethod
    def _published(case: CaseRecord, r: TestRequest) -> None:
        """The hand-off step must be published before its result may be imported: until
        then its ``publish`` (after a crash, or of a paused case) is still to come and
        would block the case again after the result was taken."""
        if case.head_seq < r.step_seq or case.current_revision != r.revision:
            raise InvestigationError(
                "TEST_REQUEST_NOT_PUBLISHED",
                f"the step that handed {r.request_id} out (step {r.step_seq}) is not "
                f"published yet; confirm again once the case is BLOCKED "
                f"(AWAITING_TEST_FEEDBACK)")

    @staticmethod
    def _lock_case(s: Session, case_id: str) -> CaseRecord:
        case = Store.lock_case(s, case_id)
        if case.state == CASE_CANCELLED:
            raise InvestigationError("CASE_CANCELLED",
                                     f"case {case_id} was cancelled; it takes no feedback")
        return case

    def _close(self, s: Session, case: CaseRecord, r: TestRequest, status: str,
               items: list[dict[str, Any]], warnings: list[str], reason: str) -> str:
        """Import the result as the hypothesis's pending evidence and unblock the case."""
        previous = r.status
        # Feedback is untrusted text that becomes evidence, context and summary: secrets in
        # it are masked like in any tool finding (investigation.secrets).
        items, masked = default_masker().mask_names(items)
        if masked:
            warnings = [*warnings, SECRET_MASKED]
        res = s.execute(update(TestRequest).where(
            col(TestRequest.id) == r.id, col(TestRequest.status) == previous).values(
            status=status, closed_at=self.clock()))
        if res.rowcount != 1:  # type: ignore[attr-defined]
            raise InvestigationError("FEEDBACK_REPLAYED", f"{r.request_id} changed meanwhile")
        result = {"operation": FEEDBACK_OPERATION,
                  "arguments": {"request_id": r.request_id, "kind": r.kind},
                  "items": items, "warnings": warnings,
                  "stats": {"status": status, **({"secrets_masked": masked} if masked else {})}}
        ev = EvidenceStore.record(s, case_id=r.case_id, revision=r.revision,
                                  step_seq=r.step_seq, hypothesis_id=r.hypothesis_id,
                                  result=result, cost_units=r.cost_units)
        s.execute(update(TestRequest).where(col(TestRequest.id) == r.id)
                  .values(evidence_id=ev.evidence_id))
        account = s.exec(select(BudgetAccount).where(
            BudgetAccount.case_id == r.case_id, BudgetAccount.revision == r.revision,
            BudgetAccount.hypothesis_id == r.hypothesis_id)).one()
        account.pending_evidence_id = ev.evidence_id
        account.no_novelty_streak = 0 if ev.new_item_count > 0 else \
            account.no_novelty_streak + 1
        s.add(account)
        if case.blocked_reason == BLOCK_AWAITING_TEST_FEEDBACK \
                and case.current_revision == r.revision:
            if case.state == CASE_BLOCKED:
                case.state = CASE_INVESTIGATING
                case.last_outcome, case.last_reason = "RESUMED", reason
            case.blocked_reason = None  # a paused case resumes into INVESTIGATING later
            case.updated_at = utcnow()
            lifecycle.record_test_result(case)
            s.add(case)
        s.flush()
        return ev.evidence_id
