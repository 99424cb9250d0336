"""Check a scripted reply file against a case before running it
(``investigate replies check FILE CASE``; ``docs/reply-contract.md``, "Checking a reply
file").

Nothing runs: no model call, no snapshot query, no write. The check replays the engine's
own rules over a simulation of the case that starts from the case as stored:

* line ``i`` of the file (non-blank lines, as the scripted provider counts them) answers
  model call ``i``; calls the case already made are reported as ``served``;
* whose turn a call is: the real scheduler (``select_hypothesis``) over the simulated
  accounts, after the real automatic dispositions;
* each line is read with the real ``read_reply`` (the stage's normalisations) and judged
  with the real
  ``validate_reply`` (the real argument preflight of the case's snapshot included) against
  a context with what validation reads: the hypothesis, its balance and closing reason, the
  other hypotheses, the evidence and question ids, the previous result, the policy;
* an accepted line's effects are applied as the stages apply them: refund, confidence,
  questions (``Q<n>`` in order), reservation, the next evidence id (``E<n>``), finish,
  reject, early-diagnosis deferral, the invalid-reply streak and ``BLOCKED``
  (``INVALID_LLM_RESPONSES``), the test hand-off (``AWAITING_TEST_FEEDBACK``), completion.

What cannot be known without running the queries: how many items a query finds and how
many are new. That decides ``SUPPORT_WITHOUT_FINDINGS``, the refunds (so
``BUDGET_UNAFFORDABLE`` and exhaustion), ``low_information`` closing turns
(``ACTION_NOT_ALLOWED``) and the early-diagnosis review. The walk therefore assumes that
every query of the file finds only new items, and judges each line a second time on the
same history as if every query of the file had found nothing (a query repeating one its
hypothesis already made is a duplicate either way: the snapshot is immutable). A line
both judge the same way gets that verdict; otherwise it is ``depends``, with both
verdicts (or both hypotheses, when whose turn it is differs). Other assumptions: external
tests can be handed out (every runtime built from settings has a feedback key) and test
feedback, when it comes, is new information.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlmodel import col, func, select

from investigation import jsonio
from investigation.budget import BudgetManager, rules
from investigation.cases.reader import PackageReader
from investigation.cases.registry import load_snapshot
from investigation.config import BudgetConfig, InvestigationConfig, LoopConfig, canonical_json
from investigation.constants import (
    BLOCK_AWAITING_TEST_FEEDBACK,
    BLOCK_INVALID_LLM_RESPONSES,
    BLOCK_PROVIDER_CONFIGURATION,
    BLOCKED,
    CASE_BLOCKED,
    CASE_BUILDING_DIAGNOSIS,
    CASE_CANCELLED,
    CASE_PAUSED,
    CASE_STOPPED,
    COMPLETED,
    DEFERRED,
    PROGRESSED,
    REJECTED,
)
from investigation.errors import InvestigationError, ToolError
from investigation.files import MAX_SCRIPT_FILE_BYTES, read_bounded
from investigation.llm.scripted import iter_script_lines
from investigation.loop.contract import QueryAction, ReplyRejected, TestAction, read_reply
from investigation.loop.scheduler import select_hypothesis
from investigation.loop.validation import AcceptedDecision, validate_reply
from investigation.store.engine import Store
from investigation.store.models import (
    BudgetAccount,
    CaseRecord,
    Evidence,
    HypothesisBirth,
    LLMOperation,
    Question,
    RevisionRecord,
    StageRun,
    TestRequest,
)
from investigation.tools import ToolRouter

#: Verdicts of one line.
ACCEPTED = "accepted"
REJECTED_VERDICT = "rejected"
DEPENDS = "depends"
SERVED = "served"
UNUSED = "unused"
UNREADABLE = "unreadable"
VERDICTS = (ACCEPTED, REJECTED_VERDICT, DEPENDS, SERVED, UNUSED, UNREADABLE)


@dataclass
class LineVerdict:
    """The verdict on one reply line.

    Attributes:
        line: 1-based physical line number in the file.
        call_index: the model call it answers (0-based), or ``None`` for an unused line.
        verdict: one of :data:`VERDICTS`.
        step_seq: the step whose call it answers (in the first world).
        hypothesis_id: whose turn it is (in the first world).
        code: the rejection code (or ``PROVIDER_SCRIPT_UNREADABLE``), if any.
        detail: the rule's explanation, or what an accepted line does.
        outcome: the step's scheduling outcome in the first world.
        other: for ``depends``: the verdict and code when the queries find nothing.
        notes: assumptions this verdict rests on.
    """

    line: int
    call_index: int | None
    verdict: str
    step_seq: int | None = None
    hypothesis_id: int | None = None
    code: str | None = None
    detail: str = ""
    outcome: str | None = None
    other: str | None = None
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"line": self.line, "call_index": self.call_index, "verdict": self.verdict,
                "step_seq": self.step_seq, "hypothesis_id": self.hypothesis_id,
                "code": self.code, "detail": self.detail, "outcome": self.outcome,
                "other": self.other, "notes": self.notes}


@dataclass
class ScriptCheck:
    """The whole check: per-line verdicts and what happens after the last line."""

    case_id: str
    path: str
    start: str
    first_call: int
    lines: list[LineVerdict]
    end: str
    policy: str
    #: Unused reply lines past the listed ones (past :data:`MAX_JUDGED_LINES` after the
    #: served ones), counted in ``counts`` and named in ``end``, not listed.
    unlisted_unused: int = 0

    @property
    def counts(self) -> dict[str, int]:
        out = {v: 0 for v in VERDICTS}
        for line in self.lines:
            out[line.verdict] += 1
        out[UNUSED] += self.unlisted_unused
        return out

    @property
    def ok(self) -> bool:
        """No line the case will read is rejected or unreadable in the first world
        (``depends`` lines are accepted there)."""
        return not any(line.verdict in (REJECTED_VERDICT, UNREADABLE) or (
            line.verdict == DEPENDS and line.code is not None) for line in self.lines)

    def to_dict(self) -> dict[str, Any]:
        return {"case_id": self.case_id, "path": self.path, "start": self.start,
                "first_call": self.first_call, "policy": self.policy, "end": self.end,
                "counts": self.counts, "ok": self.ok,
                "unlisted_unused": self.unlisted_unused,
                "lines": [line.to_dict() for line in self.lines]}


@dataclass
class _Evidence:
    evidence_id: str
    hypothesis_id: int
    cost_units: int
    item_count: int
    new_item_count: int
    duplicate: bool
    known: bool
    signature: str | None = None
    assessed: bool = False


@dataclass
class _Turn:
    hypothesis_id: int | None
    verdict: str
    code: str | None = None
    detail: str = ""
    outcome: str | None = None


class _World:
    """One simulated case: accounts, evidence and questions, advanced line by line."""

    def __init__(self, name: str, optimistic: bool, accounts: list[BudgetAccount],
                 evidence: list[_Evidence], questions: list[dict[str, Any]],
                 question_count: int, evidence_count: int, config: InvestigationConfig,
                 router: ToolRouter, step_seq: int) -> None:
        self.name = name
        self.optimistic = optimistic
        self.accounts = [BudgetAccount.model_validate(a.model_dump()) for a in accounts]
        self.evidence = [_Evidence(**vars(e)) for e in evidence]
        self.questions = [dict(q) for q in questions]
        self.question_count = question_count
        self.evidence_count = evidence_count
        self.config = config
        self.budget = BudgetManager(config.budget, config.loop)
        self.router = router
        self.step_seq = step_seq
        self.done = False
        #: Each account's balance and no-novelty streak had every query of the file found
        #: nothing (the first world's history, the second world's unknowns).
        self.empty_balance = {a.hypothesis_id: a.balance_units for a in self.accounts}
        self.empty_streak = {a.hypothesis_id: a.no_novelty_streak for a in self.accounts}

    def variant(self) -> _World:
        """This world's state had every query of the file found nothing."""
        other = _World("empty", False, self.accounts, self.evidence, self.questions,
                       self.question_count, self.evidence_count, self.config, self.router,
                       self.step_seq)
        for a in other.accounts:
            a.balance_units = self.empty_balance[a.hypothesis_id]
            a.no_novelty_streak = self.empty_streak[a.hypothesis_id]
        for e in other.evidence:
            if not e.known and not e.duplicate:
                e.item_count = e.new_item_count = 0
        return other

    def _unknown(self) -> tuple[int, int]:
        return (1, 1) if self.optimistic else (0, 0)

    def _account(self, hid: int) -> BudgetAccount:
        return next(a for a in self.accounts if a.hypothesis_id == hid)

    @staticmethod
    def _row(e: _Evidence) -> Evidence:
        """A detached evidence row with what ``closing_reason`` reads (never stored)."""
        return Evidence(case_id="", revision=0, step_seq=0, ordinal=0,
                        evidence_id=e.evidence_id, hypothesis_id=e.hypothesis_id,
                        operation="", arguments_json="{}", findings_json="[]",
                        item_keys_json="[]", warnings_json="[]", fingerprint="",
                        item_count=e.item_count, new_item_count=e.new_item_count,
                        duplicate=e.duplicate, cost_units=e.cost_units, artifact_path="",
                        artifact_sha256="")

    def next_turn(self) -> int | None:
        """Dispositions, then the scheduler: whose turn the next call is (None: complete)."""
        for a in self.accounts:
            self.budget.apply_automatic_disposition(a)
        hid = select_hypothesis(self.accounts)
        if hid is None:
            self.done = True
        return hid

    def context(self, hid: int) -> dict[str, Any]:
        account = self._account(hid)
        pending = next((e for e in self.evidence
                        if e.evidence_id == account.pending_evidence_id), None)
        closing = self.budget.closing_reason(account, self._row(pending) if pending else None)
        previous = None
        if pending is not None:
            previous = {"evidence_id": pending.evidence_id, "cost_units": pending.cost_units,
                        "novelty_permille": rules.novelty_permille(
                            pending.item_count, pending.new_item_count, pending.duplicate)}
        tests = bool(self.config.budget.test_costs)
        return {
            "hypothesis": {"id": hid, "balance_units": account.balance_units,
                           "deferred_by": account.deferred_by},
            "other_hypotheses": [
                {"id": a.hypothesis_id, "status": a.status, "confidence": a.confidence,
                 "turns": a.turns, "deferred_by": a.deferred_by}
                for a in self.accounts if a.hypothesis_id != hid],
            "external_tests": {"available": tests},
            "early_diagnosis": {"enabled": self.config.loop.early_diagnosis,
                                "min_evidence": self.config.loop.early_diagnosis_min_evidence},
            # As loop.context: a test only where a test cost is configured.
            "allowed_actions": ["finish", "reject"] if closing else
            ["query", "test", "finish", "reject"] if tests else ["query", "finish", "reject"],
            "closing_reason": closing,
            "previous_result": previous,
            "evidence": [{"evidence_id": e.evidence_id, "hypothesis_id": e.hypothesis_id,
                          "item_count": e.item_count, "new_item_count": e.new_item_count,
                          "duplicate": e.duplicate} for e in self._listed(hid, pending)],
            # As loop.context: this hypothesis's questions and the others' open ones.
            "questions": [q for q in self.questions
                          if q["hypothesis_id"] == hid or q["status"] == "open"],
        }

    def _listed(self, hid: int, pending: Any) -> list[Any]:
        """The records a real context lists (``loop.context``'s two windows), in order."""
        limits = self.config.limits
        own = [e for e in self.evidence if e.hypothesis_id == hid]
        kept = {id(e) for e in own[-limits.own_evidence_in_context:]}
        if pending is not None:
            kept.add(id(pending))
        other = [e for e in self.evidence if e.hypothesis_id != hid]
        if limits.other_evidence_in_context:
            kept |= {id(e) for e in other[-limits.other_evidence_in_context:]}
        return [e for e in self.evidence if id(e) in kept]

    def judge(self, text: str | None) -> _Turn:
        """Judge one reply (``None``: not UTF-8) and apply its effects."""
        hid = self.next_turn()
        if hid is None:
            return _Turn(None, UNUSED, outcome=COMPLETED)
        self.step_seq += 1
        account = self._account(hid)
        if text is None:
            return _Turn(hid, UNREADABLE, "PROVIDER_SCRIPT_UNREADABLE",
                         "the line is not UTF-8: the call blocks the case", BLOCKED)
        try:
            try:
                decision = validate_reply(read_reply(text)[0], self.context(hid),
                                          self.config.budget, self.router,
                                          self.config.loop.max_questions_per_hypothesis)
                canonical_json(decision.to_dict())
            except (ValueError, TypeError, OverflowError, UnicodeError,
                    RecursionError) as exc:
                raise ReplyRejected("REPLY_UNPROCESSABLE", f"the reply could not be "
                                    f"processed: {type(exc).__name__}") from exc
        except ReplyRejected as rej:
            account.invalid_streak += 1
            outcome = BLOCKED if account.invalid_streak >= \
                self.config.loop.max_invalid_responses else REJECTED
            return _Turn(hid, REJECTED_VERDICT, rej.code, rej.detail, outcome)
        return self._apply(hid, account, decision)

    def _apply(self, hid: int, account: BudgetAccount, decision: AcceptedDecision) -> _Turn:
        reply = decision.reply
        account.invalid_streak = 0
        refund = decision.projection.refund_units
        account.balance_units += refund
        pending = next((e for e in self.evidence
                        if e.evidence_id == account.pending_evidence_id), None)
        if reply.assessment is not None and pending is not None and pending.known:
            self.empty_balance[hid] += refund  # a known result refunds the same everywhere
        if reply.assessment is not None:
            for e in self.evidence:
                if e.evidence_id == account.pending_evidence_id:
                    e.assessed = True
            account.pending_evidence_id = None
        account.confidence = reply.update.confidence
        for q in self.questions:
            if q["question_id"] in reply.update.resolve_questions:
                q["status"] = "resolved"
        for text in reply.update.new_questions:
            self.question_count += 1
            self.questions.append({"question_id": f"Q{self.question_count}",
                                   "hypothesis_id": hid, "text": text, "status": "open"})
        account.turns += 1
        nxt = reply.next
        what: str
        outcome = PROGRESSED
        if isinstance(nxt, QueryAction | TestAction):
            account.balance_units -= decision.cost_units
            account.iterations += 1
            self.evidence_count += 1
            eid = f"E{self.evidence_count}"
            items, new = self._unknown()
            duplicate = False
            signature = None
            if isinstance(nxt, QueryAction):
                signature = _signature(self.router, nxt.operation, nxt.arguments)
                duplicate = any(e.signature == signature and e.hypothesis_id == hid
                                for e in self.evidence)
                if duplicate:
                    items, new = 1, 0
                what = f"query {nxt.operation} (cost {decision.cost_units}) -> {eid}" + (
                    ", a duplicate of an earlier query of this hypothesis (no refund)"
                    if duplicate else "")
            else:
                what = f"{nxt.test.kind} test (cost {decision.cost_units}); its feedback " \
                       f"becomes {eid}"
                outcome = BLOCKED
            self.evidence.append(_Evidence(eid, hid, decision.cost_units, items, new,
                                           duplicate, False, signature))
            account.pending_evidence_id = eid
            account.no_novelty_streak = 0 if new > 0 else account.no_novelty_streak + 1
            self.empty_balance[hid] -= decision.cost_units
            self.empty_streak[hid] += 1
        elif nxt.action == "finish":
            account.status, what = rules.FINISHED, "finish"
            review = decision.early_diagnosis
            if review is not None:
                for alt in review.deferred:
                    other = self._account(alt)
                    other.deferred_by, other.deferred_step = hid, self.step_seq
                what += "; early diagnosis " + ("accepted: defers " + ", ".join(
                    f"H{h}" for h in review.deferred) if review.accepted else "declined")
                if review.accepted:
                    outcome = DEFERRED
        else:
            account.status, what = rules.REJECTED, "reject"
        if refund:
            what += f"; refund {refund}"
        what += f"; balance {account.balance_units}"
        if self.empty_balance[hid] != account.balance_units:
            what += f" ({self.empty_balance[hid]} if the queries find nothing)"
        for a in self.accounts:
            self.budget.apply_automatic_disposition(a)
        if outcome != BLOCKED and all(a.status != rules.ACTIVE for a in self.accounts):
            outcome = COMPLETED
            self.done = True
        return _Turn(hid, ACCEPTED, None, what, outcome)


def _signature(router: ToolRouter, operation: str, arguments: dict[str, Any]) -> str | None:
    try:
        args = router.validate(operation, arguments).model_dump(mode="json")
    except ToolError:
        return None
    return canonical_json({"operation": operation, "arguments": args}).decode()


@contextmanager
def _router(store: Store, case_id: str, config: InvestigationConfig,
            reader: PackageReader) -> Iterator[ToolRouter]:
    router = ToolRouter(load_snapshot(store, case_id, reader), config.tools)
    try:
        yield router
    finally:
        router.close()


def check_script(store: Store, case_id: str, path: Path,
                 config: InvestigationConfig | None = None,
                 reader: PackageReader | None = None) -> ScriptCheck:
    """Judge every line of the reply file ``path`` for the case (module docstring).

    Args:
        store: the case's store (only read).
        case_id: a registered case.
        path: a JSON Lines reply file.
        config: the policy to assume when the case has not frozen one yet (its first step
            freezes it); default: the built-in defaults.
        reader: validates the stored package (default: with ``config``'s package limits).

    Raises:
        InvestigationError: ``CASE_NOT_FOUND``; ``SCRIPT_UNREADABLE`` when the file
        cannot be read.
    """
    cfg = config or InvestigationConfig()
    try:  # what the scripted provider reads, refused as it refuses it
        data = read_bounded(path, MAX_SCRIPT_FILE_BYTES)
    except OSError as exc:
        raise InvestigationError("SCRIPT_UNREADABLE",
                                 f"cannot read {path}: {exc.strerror or exc}") from exc
    with store.session() as s:
        case = s.get(CaseRecord, case_id)
        if case is None:
            raise InvestigationError("CASE_NOT_FOUND", f"no case {case_id}")
        revision = case.current_revision
        rev = s.exec(select(RevisionRecord).where(RevisionRecord.case_id == case_id,
                                                  RevisionRecord.revision == revision)).one()
        policy = "the built-in defaults" if config is None else "the given --config"
        if rev.policy_json is not None:
            stored = jsonio.loads(rev.policy_json)
            cfg = cfg.model_copy(update={"loop": LoopConfig.model_validate(stored["loop"]),
                                         "budget": BudgetConfig.model_validate(stored["budget"])})
            policy = "the case's frozen policy"
        births = sorted(b.hypothesis_id for b in s.exec(select(HypothesisBirth).where(
            HypothesisBirth.case_id == case_id, HypothesisBirth.revision == revision)))
        stored_accounts = {a.hypothesis_id: a for a in s.exec(select(BudgetAccount).where(
            BudgetAccount.case_id == case_id, BudgetAccount.revision == revision))}
        evidence_rows = s.exec(select(Evidence).where(
            Evidence.case_id == case_id, Evidence.revision == revision)
            .order_by(col(Evidence.ordinal))).all()
        evidence_count = s.exec(select(func.max(Evidence.ordinal)).where(
            Evidence.case_id == case_id)).one() or 0
        question_rows = s.exec(select(Question).where(
            Question.case_id == case_id, Question.revision == revision)
            .order_by(col(Question.ordinal))).all()
        question_count = len(s.exec(select(Question.id).where(
            Question.case_id == case_id)).all())
        calls = len(s.exec(select(StageRun.id).where(
            StageRun.case_id == case_id, StageRun.stage == "llm_call")).all())
        awaiting = s.exec(select(TestRequest).where(
            TestRequest.case_id == case_id,
            col(TestRequest.status).in_(("awaiting", "submitted")))
            .order_by(col(TestRequest.id))).all()
        state, reason, head = case.state, case.blocked_reason, case.head_seq
        served = {call: digest for call, digest in s.exec(
            select(LLMOperation.call_index, LLMOperation.response_sha256).where(
                LLMOperation.case_id == case_id, LLMOperation.status == "succeeded"))}
    # Only the lines the check can judge are kept: the served ones, MAX_JUDGED_LINES
    # past them and one more; the rest are counted (a 40 MB file of 20 million lines
    # took 8 GB as a list of lines and verdicts, a hostile-input trial).
    lines: list[tuple[int, bytes]] = []
    rest, last_number = 0, 0
    try:
        for item in iter_script_lines(data, path):
            if len(lines) <= calls + MAX_JUDGED_LINES:
                lines.append(item)
            else:
                rest += 1
            last_number = item[0]
    except OSError as exc:
        raise InvestigationError("SCRIPT_UNREADABLE",
                                 f"cannot read {path}: {exc.strerror or exc}") from exc
    del data
    credit = cfg.budget.credit_units
    accounts = [stored_accounts.get(h) or BudgetAccount(
        case_id=case_id, revision=revision, hypothesis_id=h, credit_units=credit,
        balance_units=credit) for h in births]
    evidence = [_Evidence(e.evidence_id, e.hypothesis_id, e.cost_units, e.item_count,
                          e.new_item_count, e.duplicate, True,
                          canonical_json({"operation": e.operation,
                                          "arguments": jsonio.loads(e.arguments_json)}).decode(),
                          e.assessed) for e in evidence_rows]
    for t in awaiting:  # feedback not in yet: it becomes the next evidence id
        evidence_count += 1
        evidence.append(_Evidence(f"E{evidence_count}", t.hypothesis_id, t.cost_units, 1, 1,
                                  False, False))
        # ... and, once confirmed, the pending result its hypothesis's next turn assesses
        for account in accounts:
            if account.hypothesis_id == t.hypothesis_id:
                account.pending_evidence_id = f"E{evidence_count}"
    questions = [{"question_id": q.question_id, "hypothesis_id": q.hypothesis_id,
                  "text": q.text, "status": q.status} for q in question_rows]
    start = _start(state, reason, head, calls, lines)
    reader = reader or PackageReader(cfg.package)
    with _router(store, case_id, cfg, reader) as router:
        world = _World("find", True, accounts, evidence, questions, question_count,
                       evidence_count, cfg, router, head)
        verdicts, end = _walk(lines, calls, world,
                              state in (CASE_BUILDING_DIAGNOSIS, CASE_CANCELLED, CASE_STOPPED),
                              rest, last_number)
    _note_spread_reply(lines, verdicts)
    _note_edited_served(lines, verdicts, served)
    unlisted = rest if verdicts and verdicts[-1].verdict == UNUSED else 0
    return ScriptCheck(case_id=case_id, path=str(path), start=start, first_call=calls,
                       lines=verdicts, end=end, policy=policy, unlisted_unused=unlisted)


def _note_edited_served(lines: list[tuple[int, bytes]], verdicts: list[LineVerdict],
                        served: dict[int, str | None]) -> None:
    """Note a served line that differs from the reply its call got (``served``: call
    index -> the stored response's sha256): a new user fixed a rejected line in place,
    the check said ``served`` and the case, which keeps what it got, read on from the next
    line. Only when another served line is byte for byte its stored reply, so that the
    file is the one that served the case (an HTTP provider's stored response is a whole
    chat completion, never a line)."""
    digests = {v.line: hashlib.sha256(raw).hexdigest() for v, (_, raw) in
               zip(verdicts, lines, strict=False) if v.verdict == SERVED}
    by_call = {v.call_index: v for v in verdicts
               if v.verdict == SERVED and v.call_index is not None}
    same = [c for c, v in by_call.items() if served.get(c) == digests[v.line]]
    if not same:
        return
    for call, v in by_call.items():
        if served.get(call) not in (None, digests[v.line]):
            v.notes.append(f"edited since call {call + 1} read it: the case keeps the reply "
                           "it got, so this edit changes nothing; what comes next is read "
                           "from the lines after the served ones")


#: How many lines, and how many first lines, :func:`_note_spread_reply` tries.
_SPREAD_LINES = 200
_SPREAD_TRIES = 5


def _note_spread_reply(lines: list[tuple[int, bytes]], verdicts: list[LineVerdict]) -> None:
    """Note, on its first line, a reply written over several lines: each of its lines is
    refused as ``REPLY_NOT_JSON`` (a new user pasted reply-contract.md's pretty-printed
    example and read five rejections without a word on why). Tries the first
    :data:`_SPREAD_TRIES` refused lines that open an object, joining up to
    :data:`_SPREAD_LINES` lines each."""
    by_line = {v.line: v for v in verdicts}
    tries = 0
    for i, (number, raw) in enumerate(lines):
        v = by_line.get(number)
        if v is None or v.code != "REPLY_NOT_JSON" or not raw.lstrip().startswith(b"{"):
            continue
        if (tries := tries + 1) > _SPREAD_TRIES:
            return
        text = raw
        for last, more in lines[i + 1:i + _SPREAD_LINES]:
            text += b"\n" + more
            try:
                jsonio.loads(text)
            except (ValueError, RecursionError):
                continue
            v.notes.append(f"lines {number}-{last} together are one JSON document, written "
                           "over several lines: a reply file holds one reply per line "
                           "(JSON Lines); write it on one line (`jq -c . reply.json` "
                           "prints it so)")
            return


def _start(state: str, reason: str | None, head: int, calls: int,
           lines: list[tuple[int, bytes]]) -> str:
    where = f"{head} published step(s), {calls} model call(s) made"
    # What the next call reads: the file's own line number of its reply (blank lines are
    # skipped, so it can be past calls + 1), or where that reply is missing.
    line = f"reply line {lines[calls][0]}" if calls < len(lines) else \
        f"reply line {(lines[-1][0] if lines else 0) + 1} (not written yet)" \
        if calls == len(lines) else _past_the_end(calls, len(lines))
    if state == CASE_BUILDING_DIAGNOSIS:
        return f"the case is complete ({where}): no line will be read"
    if state in (CASE_CANCELLED, CASE_STOPPED):
        return f"the case is {state} ({where}): no line will be read"
    if state == CASE_PAUSED:
        return f"the case is paused ({where}); after `resume`, call {calls + 1} reads {line}"
    if state == CASE_BLOCKED:
        if reason == BLOCK_AWAITING_TEST_FEEDBACK:
            return (f"the case waits for test feedback ({where}); once it is confirmed, call "
                    f"{calls + 1} reads {line}")
        return (f"the case is blocked ({reason}; {where}); after `resume`, call {calls + 1} "
                f"reads {line}")
    return f"{where}: the next call ({calls + 1}) reads {line}"


def _past_the_end(calls: int, replies: int) -> str:
    """Where the next call's reply is when the file holds fewer reply lines than the case
    made calls: call N reads the N-th reply line (a 3-line file against a case of 500
    calls was told "call 501 reads reply line 4", a 500-step case's reader)."""
    return (f"the file's reply {calls + 1}, past its end (it holds {replies} reply "
            f"line(s) for the {calls} call(s) made: call N reads the N-th reply line, blank "
            "lines not counted)")


#: Reply lines judged past the served ones: a line costs about half a millisecond and a
#: verdict's memory (200,000 lines of a valid reply ran past two minutes and 271 MB; a
#: hostile-input trial). The lines after them are named in the check's end, not judged.
MAX_JUDGED_LINES = 10_000


def _walk(lines: list[tuple[int, bytes]], first_call: int, main: _World,
          finished: bool, rest: int = 0,
          last_number: int | None = None) -> tuple[list[LineVerdict], str]:
    """Judge ``lines`` in order; ``rest`` more reply lines follow them in the file (not
    kept), the last at ``last_number``."""
    last_number = last_number or (lines[-1][0] if lines else 0)
    verdicts: list[LineVerdict] = []
    #: Why the case stops at the last judged line (its block reason), if it does.
    stops: str | None = None
    for call, (number, raw) in enumerate(lines):
        stops = None
        if call >= first_call + MAX_JUDGED_LINES and not (finished or main.done):
            return verdicts, (
                f"the check stopped after judging {MAX_JUDGED_LINES} lines: lines "
                f"{number}-{last_number} ({len(lines) - call + rest} reply line(s)) were "
                "not judged; check them once the case has read the lines before them")
        if call < first_call:
            verdicts.append(LineVerdict(number, call, SERVED,
                                        detail=f"call {call + 1} was already made; the case "
                                               "will not read this line again"))
            continue
        if finished or main.done:
            verdicts.append(LineVerdict(number, None, UNUSED,
                                        detail="never read: the case is complete before"))
            continue
        try:
            text: str | None = raw.decode("utf-8")
        except UnicodeDecodeError:
            text = None
        b = main.variant().judge(text)  # the same history, had the queries found nothing
        a = main.judge(text)
        if a.verdict == UNUSED:
            verdicts.append(LineVerdict(number, None, UNUSED,
                                        detail="never read: the case is complete before"))
            continue
        v = LineVerdict(number, call, a.verdict, main.step_seq, a.hypothesis_id, a.code,
                        a.detail, a.outcome)
        if b.hypothesis_id != a.hypothesis_id:
            v.verdict = DEPENDS
            v.other = (f"H{b.hypothesis_id}'s turn" if b.hypothesis_id is not None
                       else "the case is complete before this call")
            v.notes.append(f"H{a.hypothesis_id}'s turn if the queries find new items; "
                           f"{v.other} if they find nothing")
        elif (b.verdict, b.code) != (a.verdict, a.code):
            v.verdict = DEPENDS
            v.other = b.verdict + (f" {b.code}: {b.detail}" if b.code else "")
            v.notes.append(f"{a.verdict}{' ' + a.code if a.code else ''} if the queries "
                           f"find new items; {v.other} if they find nothing")
        if a.outcome == BLOCKED and a.verdict == REJECTED_VERDICT:
            stops = BLOCK_INVALID_LLM_RESPONSES
            v.notes.append(f"the case blocks here ({stops}); after "
                           f"`investigate resume` {_line_after(lines, call)}")
        elif a.outcome == BLOCKED and a.verdict == ACCEPTED:
            stops = BLOCK_AWAITING_TEST_FEEDBACK
            v.notes.append(f"the case waits here ({stops}) until the feedback is confirmed")
        elif a.outcome == BLOCKED:
            stops = BLOCK_PROVIDER_CONFIGURATION
            v.notes.append(f"the case blocks here ({stops}): fix the line, then "
                           "`investigate resume CASE --retry-id NEW`")
        verdicts.append(v)
    never = (f"; the {rest} reply line(s) after line {lines[-1][0]}, to line "
             f"{last_number}, are never read either (not listed one by one)"
             if rest and lines else "")
    if finished:
        end = "the case is already finished" + never
    elif main.done or main.next_turn() is None:
        end = ("the case completes (every hypothesis account is terminal) within the file"
               + never)
    else:
        # A last line that hands out a test stops the case there first (a new user's trial
        # read only the exhausted script here, while `run` stopped awaiting feedback), and
        # so does one that blocks it (a trial read "the case blocks here" on the line, then
        # only "call 2 finds no reply" here).
        end = (f"the file ends after {len(lines)} reply line(s): "
               + (f"the case first waits for the test feedback line {verdicts[-1].line} asks "
                  f"for ({stops}); once it is confirmed, "
                  if stops == BLOCK_AWAITING_TEST_FEEDBACK else
                  f"the case blocks at its last line, {verdicts[-1].line} ({stops}); once "
                  "it is resumed, " if stops else "")
               + f"call {max(len(lines), first_call) + 1} finds no reply and blocks the "
               "case (PROVIDER_CONFIGURATION, PROVIDER_SCRIPT_EXHAUSTED); add replies to "
               "continue" + (f": call {first_call + 1} reads "
                             f"{_past_the_end(first_call, len(lines))}"
                             if first_call > len(lines) else ""))
    return verdicts, end


def _line_after(lines: list[tuple[int, bytes]], call: int) -> str:
    if call + 1 < len(lines):
        return f"the next call reads line {lines[call + 1][0]}"
    return "the next call finds no line: add replies after this one first"
