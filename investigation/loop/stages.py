"""The eight stages of one step (DESIGN.md "One step, eight stages"; seed 000 cycle).

Each stage is written once and called by both runtimes (``Investigator.step`` in process,
one Celery task per stage in ``workers``) through ``loop.stagebase.StageFramework.run``,
which opens the stage's transaction, fences it and counts its delivery; a body's first
``with self._tx() as s:`` block continues that transaction. Rules every stage follows:

* Idempotent by ``(case_id, revision, step_seq, stage)``: a finished stage has a
  ``stage_run`` row holding its output, written in the same transaction as its effects.
  Running it again returns that output and changes nothing.
* Fenced: every write transaction first checks that the case head is still
  ``step_seq - 1`` on the same revision; a stale worker gets ``StaleStateError``.
  Publishing is a compare-and-set on the head, backed by the unique ``(case_id, seq)``.
* No sleeping: provider backoff ends ``llm_call`` with ``RETRY_PENDING`` and a
  ``retry_not_before``; the runtime decides when to come back.
* External effects (the model call, the snapshot query) happen outside transactions;
  their results are stored before anything depends on them.
"""

from __future__ import annotations

import logging
import sqlite3
from typing import Any

from sqlalchemy import bindparam, func, insert
from sqlalchemy import select as sa_select
from sqlalchemy.orm.attributes import set_committed_value
from sqlmodel import Session, col, select

from investigation import jsonio
from investigation.budget import rules
from investigation.budget.manager import newest_balance_of
from investigation.config import canonical_json, ordered_json
from investigation.constants import (
    ARTIFACT_CONTEXT,
    ARTIFACT_PLAN,
    ARTIFACT_RAW_RESULT,
    ARTIFACT_REPLY_SCHEMA,
    BLOCK_AWAITING_TEST_FEEDBACK,
    BLOCK_INVALID_LLM_RESPONSES,
    BLOCKED,
    CASE_BLOCKED,
    CASE_BUILDING_DIAGNOSIS,
    CASE_CANCELLED,
    CASE_HELD,
    CASE_INVESTIGATING,
    CASE_PAUSED,
    CASE_STOPPED,
    COMPLETED,
    DEFERRED,
    POINTER_STATE,
    PROGRESSED,
    PROMPT_VERSION,
    REJECTED,
    REPLY_SCHEMA_VERSION,
    RETRY_PENDING,
)
from investigation.errors import InvestigationError, StaleStateError, ToolError
from investigation.evidence import EvidenceStore
from investigation.external_tests import AsyncTestCoordinator
from investigation.lifecycle import SessionState, TerminationReason
from investigation.llm.gateway import Blocked, RetryPending, Succeeded
from investigation.llm.spend import to_micros
from investigation.llm.types import ChatRequest
from investigation.loop import checkpoints, lifecycle, live
from investigation.loop import context as context_builder
from investigation.loop.contract import (
    Reply,
    ReplyRejected,
    normalise_reply_text,
    read_reply,
    reply_json_schema,
)
from investigation.loop.outcome import Outcome, StageResult, StepKey
from investigation.loop.prompt import build_messages
from investigation.loop.reply_schema import turn_schema
from investigation.loop.scheduler import next_turn
from investigation.loop.stagebase import SKIPPED, StageFramework, _AlreadyRecorded, _loads
from investigation.loop.summary import write_summary
from investigation.loop.validation import validate_reply
from investigation.secrets import default_masker
from investigation.store.engine import Store, core, deferred, table_of
from investigation.store.models import (
    BudgetAccount,
    CaseRecord,
    Evidence,
    HypothesisBirth,
    HypothesisNote,
    Plan,
    Question,
    StageRun,
    utcnow,
)
from investigation.tools.models import SECRET_MASKED

log = logging.getLogger(__name__)


# Statements built once (building a statement costs more than running it on SQLite).
_BIRTH = table_of(HypothesisBirth).c
_RUNS = table_of(StageRun).c
#: The revision's hypotheses (id and statement) with their ledger's sums (the budget
#: origins ``build_context`` verifies) and, on every row, the case's model decisions so
#: far (its ``llm_call`` markers: the next decision's ``call_index``).
_BIRTHS = sa_select(
    _BIRTH.hypothesis_id, _BIRTH.statement,
    sa_select(func.count()).select_from(table_of(StageRun)).where(
        _RUNS.case_id == bindparam("case_id"), _RUNS.stage == "llm_call")
    .scalar_subquery().label("llm_calls"),
    newest_balance_of(_BIRTH.hypothesis_id).label("ledger_balance")).where(
    _BIRTH.case_id == bindparam("case_id"), _BIRTH.revision == bindparam("revision")) \
    .order_by(_BIRTH.hypothesis_id)
#: Nobody reads the insert's result: on PostgreSQL it goes out with the marker and the
#: COMMIT (decision 130).
_PLAN_INSERT = deferred(insert(table_of(Plan)))
_CASES = table_of(CaseRecord)
#: Publishing's compare-and-set of the case head (the values come with the parameters).
_CASE_PUBLISH = _CASES.update().where(_CASES.c.id == bindparam("id_"),
                                      _CASES.c.head_seq == bindparam("head_"))
_LLM_CALLS = select(func.count()).select_from(StageRun).where(
    col(StageRun.case_id) == bindparam("case_id"), col(StageRun.stage) == "llm_call")
_NOTE_INSERT = insert(table_of(HypothesisNote))
#: The pending record a settlement assesses, a question a reply resolves (ORM objects:
#: the stage changes them) and the case's number of questions (the next ``Q`` ordinal).
_PENDING = select(Evidence).where(col(Evidence.case_id) == bindparam("case_id"),
                                  col(Evidence.evidence_id) == bindparam("evidence_id"))
_QUESTION = select(Question).where(col(Question.case_id) == bindparam("case_id"),
                                   col(Question.question_id) == bindparam("question_id"))
_QUESTION_COUNT = select(func.count()).select_from(Question).where(
    col(Question.case_id) == bindparam("case_id"))


def _failed_result(nxt: dict[str, Any], code: str, message: str) -> bytes:
    """A tool result that records a failed execution as an empty finding. The message
    may quote the snapshot (SQLite's error text quotes values): secrets in it are masked
    (``SECRET_MASKED``) like in any finding."""
    shown, masked = default_masker().mask_names(message)
    return canonical_json({
        "operation": nxt["operation"], "arguments": nxt["arguments"], "items": [],
        "warnings": ["TOOL_FAILED", *([SECRET_MASKED] if masked else [])],
        "stats": {"error_code": code, "error": shown,
                  **({"secrets_masked": masked} if masked else {})}})


class Stages(StageFramework):
    """The stage functions. ``run(stage, key)`` (``loop.stagebase``) is the only entry
    point runtimes use."""

    SNAPSHOT_STAGES = frozenset({"build_context", "validate", "execute_tool"})
    CASE_STAGES = frozenset({"build_context", "publish"})
    EFFECT_STAGES = frozenset({"llm_call", "execute_tool"})

    @staticmethod
    def _reply_schema(s: Session, key: StepKey, built: dict[str, Any]) -> dict[str, Any]:
        """The step's stored reply schema (sha256 re-checked); steps planned before the
        per-turn schema existed fall back to the static reply schema."""
        path = built.get("reply_schema_path")
        if path is None:
            return reply_json_schema()
        art = Store.get_artifact(s, key.case_id, path)
        if art is None or art.sha256 != built.get("reply_schema_sha256"):
            raise InvestigationError(
                "CONTEXT_IDENTITY", f"the stored reply schema of step {key.step_seq} was "
                "changed")
        return dict(jsonio.loads_shared(art.data, art.sha256))

    # -- 1. build_context ----------------------------------------------------------------

    def _build_context(self, key: StepKey) -> StageResult:
        router = self.env.router(key.case_id)
        with self._tx() as s:
            case = self._fence(s, key, "build_context")
            head = checkpoints.replay(s, case, self.env.replay_cache, self.env.limits_key)
            checked = live.verify_live_state(s, case, head.head_state, head.head_seq,
                                             head.head_revision, full=head.full,
                                             recorded=head.evidence)
            cfg, budget = self._policy(s, key)
            if key.step_seq > cfg.limits.max_checkpoints:
                raise InvestigationError(
                    "CHECKPOINT_LIMIT",
                    f"case {key.case_id} reached {cfg.limits.max_checkpoints} checkpoints; "
                    "raise limits.max_checkpoints to continue")
            births = list(core(s).execute(_BIRTHS, {"case_id": key.case_id,
                                                    "revision": key.revision}).all())
            accounts = budget.ensure_accounts(
                s, key.case_id, key.revision, sorted(b.hypothesis_id for b in births),
                known=checked.accounts if checked is not None else None)
            rev = Store.revision_columns(s, key.case_id, key.revision)
            lifecycle.ensure_started(case, cfg, len(births), lambda: str(
                jsonio.loads(rev.interpretation_json).get("summary", "")))
            s.add(case)
            # The newest ledger balances were read with the hypotheses; the whole ledger is
            # read at full depth, and when an account (and its credit) was created since or
            # an account has no hypothesis (decision 121).
            born = {b.hypothesis_id for b in births}
            incremental = checked is not None and not head.full and \
                {a.hypothesis_id for a in checked.accounts} == born == \
                {a.hypothesis_id for a in accounts}
            budget.verify_all_origins(s, accounts, {
                b.hypothesis_id: b.ledger_balance for b in births} if incremental else None)
            for account in accounts:
                budget.apply_automatic_disposition(account)
                s.add(account)
            selection = next_turn(accounts)
            if selection is None:
                return self._complete(s, key, "build_context", {"finalize": True})
            selected = selection.hypothesis_id
            llm_steps = births[0].llm_calls if births else \
                s.exec(_LLM_CALLS, params={"case_id": key.case_id}).one()
            doc = context_builder.build(
                s, key=key, case=case, config=cfg, budget=budget, selected=selected,
                accounts=accounts, births=births, router=router,
                snapshot=self.env.snapshot(key.case_id),
                external_tests=self.env.feedback_key is not None,
                questions=checked.questions if checked is not None else None,
                evidence_count=checked.evidence_count if checked is not None else None)
            data = context_builder.fit_for_model(
                doc, cfg.limits.max_context_bytes, self.env.gateway.prompt_budget())
            path = ARTIFACT_CONTEXT.format(seq=key.step_seq)
            digest = Store.put_artifact(s, key.case_id, path, data)
            # Parsed once per process for the stages that read it (llm_call, validate).
            schema = turn_schema(jsonio.loads_shared(data, digest),
                                 cfg.loop.max_questions_per_hypothesis)
            schema_path = ARTIFACT_REPLY_SCHEMA.format(seq=key.step_seq)
            # Key order kept: it is the order a grammar-constrained decoder writes keys in.
            schema_digest = Store.put_artifact(s, key.case_id, schema_path,
                                               ordered_json(schema))
            return self._complete(s, key, "build_context", {
                "finalize": False, "hypothesis_id": selected, "context_path": path,
                "context_sha256": digest, "call_index": llm_steps,
                "closing_reason": doc["closing_reason"], "policy_sha256": rev.policy_sha256,
                "reply_schema_path": schema_path, "reply_schema_sha256": schema_digest,
                "selection": selection.to_dict(),
            })

    # -- 2. llm_call ---------------------------------------------------------------------

    def _llm_call(self, key: StepKey) -> StageResult:
        with self._tx() as s:
            built = self._output(s, key, "build_context")
            if built["finalize"]:
                return self._complete(s, key, "llm_call", SKIPPED)
            # The context's and the reply schema's rows in one query (both checked below).
            Store.prefetch_artifacts(s, key.case_id, [built["context_path"], *(
                [built["reply_schema_path"]] if built.get("reply_schema_path") else [])])
            _, context_bytes = self._context_bytes(s, key)
            context = jsonio.loads_shared(context_bytes, built["context_sha256"])
            schema = self._reply_schema(s, key, built)
            retry_id = self._fenced(s, key, "llm_call").llm_retry_id
            limits = self.env.config.limits  # operational bounds: not frozen
            cap = None if limits.max_model_cost is None else to_micros(limits.max_model_cost)
            request = ChatRequest(
                messages=build_messages(context_bytes, context), response_schema=schema,
                schema_name="investigation_reply", call_index=int(built["call_index"]),
                case_id=key.case_id,
                metadata={"case_id": key.case_id, "step_seq": str(key.step_seq),
                          "hypothesis_id": str(built["hypothesis_id"]),
                          "prompt_version": PROMPT_VERSION},
                money_cap_micros=cap, currency=limits.currency,
                max_response_bytes=limits.max_artifact_bytes)
            # The model operation is looked up or created in this fenced transaction (the
            # case row serialises its creators); the call itself runs after the commit.
            opened = self.env.gateway.open_operation(s, key.case_id, key.revision,
                                                     key.step_seq, request, retry_id)
        result = self.env.gateway.call(key.case_id, key.revision, key.step_seq, request,
                                       retry_id=retry_id, opened=opened)
        hid = int(built["hypothesis_id"])
        if isinstance(result, RetryPending):
            with self._tx() as s:
                case = self._fence(s, key, "llm_call")
                case.retry_not_before = result.retry_not_before
                case.last_outcome, case.last_reason = RETRY_PENDING, result.error_code
                case.updated_at = utcnow()
                s.add(case)
            return StageResult({}, Outcome(RETRY_PENDING, key.case_id, key.step_seq,
                                           result.error_code, result.retry_not_before, hid))
        if isinstance(result, Blocked):
            with self._tx() as s:
                case = self._fence(s, key, "llm_call")
                case.state, case.blocked_reason = CASE_BLOCKED, result.reason
                case.last_outcome, case.last_reason = BLOCKED, result.reason
                case.retry_not_before = None
                case.updated_at = utcnow()
                s.add(case)
            log.info("case %s blocked: %s (%s)", key.case_id, result.reason, result.error_code)
            return StageResult({}, Outcome(BLOCKED, key.case_id, key.step_seq, result.reason,
                                           hypothesis_id=hid,
                                           details={"error_code": result.error_code,
                                                    "message": result.message}))
        assert isinstance(result, Succeeded)
        content = result.content
        try:
            content.encode("utf-8")
        except UnicodeEncodeError:
            # Lone surrogates from a provider: keep them visible as escapes so the reply is
            # stored and then rejected by validation, instead of wedging the step.
            content = content.encode("utf-8", "backslashreplace").decode("utf-8")
        # The answer is stored already (the gateway's own transaction waited for the
        # disk): the marker that refers to it is derived.
        with self._tx(derived=True) as s:
            self._fenced(s, key, "llm_call")
            return self._complete(s, key, "llm_call", {
                "operation_id": result.operation_id, "attempt": result.attempt,
                "provider": result.provider, "content": content,
                "response_sha256": result.response_sha256,
                "request_sha256": result.request_sha256,
                **({"finish_reason": result.finish_reason,
                    "completion_tokens": result.completion_tokens}
                   if result.finish_reason == "length" else {}),
            })

    # -- 3. validate ---------------------------------------------------------------------

    def _validate(self, key: StepKey) -> StageResult:
        router = self.env.router(key.case_id)
        with self._tx() as s:
            self._fenced(s, key, "validate")
            call = self._output(s, key, "llm_call")
            if call.get("skipped"):
                return self._complete(s, key, "validate", SKIPPED)
            built, doc = self._context_doc(s, key)
            cfg, _ = self._policy(s, key)
            account = self._account(s, key, int(built["hypothesis_id"]))
            normalised: list[str] | None = None  # the rules applied, once it is read
            try:
                try:
                    reply, applied = self._read_reply(call)
                    normalised = list(applied)
                    decision = validate_reply(reply, doc, cfg.budget,
                                              router, cfg.loop.max_questions_per_hypothesis)
                    accepted: dict[str, Any] = {"accepted": True,
                                                "decision": decision.to_dict()}
                    canonical_json(accepted["decision"])  # it must be storable
                except (ValueError, TypeError, OverflowError, UnicodeError,
                        RecursionError) as exc:
                    # No reply may crash the stage: what cannot be judged is rejected.
                    raise ReplyRejected("REPLY_UNPROCESSABLE",
                                        f"the reply could not be processed: "
                                        f"{type(exc).__name__}") from exc
            except ReplyRejected as rej:
                if normalised is None:  # it could not be read: what normalising did
                    normalised = list(normalise_reply_text(call["content"])[1])
                account.invalid_streak += 1
                account.last_rejection_json = canonical_json(
                    {"code": rej.code, "detail": rej.detail, "step_seq": key.step_seq}).decode()
                s.add(account)
                log.info("case %s step %s: reply rejected (%s)", key.case_id, key.step_seq,
                         rej.code)
                rejected: dict[str, Any] = {"accepted": False, "code": rej.code,
                                            "detail": rej.detail}
                if normalised:
                    rejected["normalised"] = normalised
                return self._complete(s, key, "validate", rejected)
            if account.invalid_streak or account.last_rejection_json is not None:
                account.invalid_streak = 0  # (an unchanged account is not written at all)
                account.last_rejection_json = None
                s.add(account)
            if normalised:
                accepted["normalised"] = normalised
            return self._complete(s, key, "validate", accepted)

    @staticmethod
    def _read_reply(call: dict[str, Any]) -> tuple[Reply, tuple[str, ...]]:
        """Normalise and parse the call's content; a reply the provider cut at its token
        limit that does not parse is ``REPLY_TRUNCATED`` (never resent unchanged: the next
        request carries the rejection)."""
        try:
            return read_reply(call["content"])
        except ReplyRejected as rej:
            if rej.code == "REPLY_NOT_JSON" and call.get("finish_reason") == "length":
                raise ReplyRejected(
                    "REPLY_TRUNCATED",
                    f"the reply was cut off at the provider's token limit "
                    f"({call.get('completion_tokens') or 'max_tokens'} tokens) before the JSON "
                    "object ended; write shorter text fields") from rej
            raise

    # -- 4. persist_plan -----------------------------------------------------------------

    def _persist_plan(self, key: StepKey) -> StageResult:
        with self._tx() as s:
            self._fenced(s, key, "persist_plan")
            verdict = self._output(s, key, "validate")
            if not verdict.get("accepted"):
                return self._complete(s, key, "persist_plan", SKIPPED)
            built = self._output(s, key, "build_context")
            call = self._output(s, key, "llm_call")
            decision = verdict["decision"]
            nxt = decision["reply"]["next"]
            plan = {
                "case_id": key.case_id, "revision": key.revision, "step_seq": key.step_seq,
                "hypothesis_id": built["hypothesis_id"], "decision": decision,
                "llm_operation_id": call["operation_id"], "llm_attempt": call["attempt"],
                "request_sha256": call["request_sha256"],
                "output_sha256": call["response_sha256"],
                "context_sha256": built["context_sha256"], "prompt_version": PROMPT_VERSION,
                "schema_version": REPLY_SCHEMA_VERSION,
            }
            data = canonical_json(plan)
            path = ARTIFACT_PLAN.format(seq=key.step_seq)
            digest = Store.put_artifact(s, key.case_id, path, data)
            # A plan row is written once, here, and never through the ORM: one Core INSERT.
            core(s).execute(_PLAN_INSERT, {
                "case_id": key.case_id, "revision": key.revision, "step_seq": key.step_seq,
                "hypothesis_id": int(built["hypothesis_id"]), "action": nxt["action"],
                "operation": nxt.get("operation"),
                "arguments_json": canonical_json(nxt["arguments"]).decode()
                if "arguments" in nxt else None,
                "decision_json": canonical_json(decision).decode(),
                "llm_operation_id": call["operation_id"], "llm_attempt": call["attempt"],
                "request_sha256": call["request_sha256"],
                "output_sha256": call["response_sha256"],
                "context_sha256": built["context_sha256"], "prompt_version": PROMPT_VERSION,
                "schema_version": REPLY_SCHEMA_VERSION, "plan_path": path,
                "plan_sha256": digest})
            return self._complete(s, key, "persist_plan",
                                  {"plan_path": path, "plan_sha256": digest})

    # -- 5. settle_reserve ---------------------------------------------------------------

    def _settle_reserve(self, key: StepKey) -> StageResult:
        with self._tx() as s:
            self._fenced(s, key, "settle_reserve")
            if self._output(s, key, "persist_plan").get("skipped"):
                return self._complete(s, key, "settle_reserve", SKIPPED)
            built = self._output(s, key, "build_context")
            decision = self._output(s, key, "validate")["decision"]
            reply, projection = decision["reply"], decision["projection"]
            _, budget = self._policy(s, key)
            hid = int(built["hypothesis_id"])
            account = self._account(s, key, hid)
            refund = 0
            if reply["assessment"] is not None:
                pending = s.exec(_PENDING, params={
                    "case_id": key.case_id, "evidence_id": account.pending_evidence_id}).one()
                refund = budget.settle(s, account, pending, int(reply["assessment"]["score"]),
                                       key.step_seq)
            if refund != projection["refund_units"]:
                raise InvestigationError(
                    "SETTLEMENT_MISMATCH",
                    f"refund {refund} differs from the validated projection "
                    f"{projection['refund_units']}")
            self._apply_update(s, key, account, reply["update"])
            account.turns += 1
            nxt = reply["next"]
            if nxt["action"] in ("query", "test"):
                budget.reserve(s, account, int(decision["cost_units"]), key.step_seq,
                               f"step {key.step_seq} {nxt.get('operation', 'test')}")
                account.iterations += 1
            else:
                closing = built.get("closing_reason")
                reason = f"{closing}: {nxt['reason']}" if closing else nxt["reason"]
                if nxt["action"] == "finish":
                    budget.complete(account, reason)
                    self._apply_deferral(s, key, hid, decision.get("early_diagnosis"))
                else:
                    budget.reject(account, reason)
            s.add(account)
            return self._complete(s, key, "settle_reserve", {
                "refund_units": refund, "reserved_units": projection["reserve_units"],
                "balance_units": account.balance_units, "status": account.status})

    def _apply_deferral(self, s: Session, key: StepKey, hid: int,
                        review: dict[str, Any] | None) -> None:
        """Mark the alternatives of an accepted early-diagnosis review assessment-only."""
        if not review or not review["accepted"]:
            return
        for alt in review["deferred"]:
            other = self._account(s, key, int(alt))
            if other.status != rules.ACTIVE or other.deferred_by is not None:
                raise StaleStateError(  # validation saw it active in this step's context
                    f"hypothesis {alt} changed since the early-diagnosis review")
            other.deferred_by, other.deferred_step = hid, key.step_seq
            s.add(other)

    def _apply_update(self, s: Session, key: StepKey, account: BudgetAccount,
                      upd: dict[str, Any]) -> None:
        account.confidence = upd["confidence"]
        if upd["note"]:  # a write-once row: the account does not grow with its notes
            core(s).execute(_NOTE_INSERT, {
                "case_id": key.case_id, "revision": key.revision,
                "hypothesis_id": account.hypothesis_id, "step_seq": key.step_seq,
                "note": upd["note"]})
        # The account and the assessed record are written once, at the commit: these reads
        # of questions need nothing of them flushed first (new questions are added after).
        with s.no_autoflush:
            for qid in upd["resolve_questions"]:
                q = s.exec(_QUESTION, params={"case_id": key.case_id,
                                              "question_id": qid}).one()
                if q.status == "open":  # re-confirming a resolved question is idempotent
                    q.status = "resolved"
                    q.resolved_step = key.step_seq
                    q.resolution_evidence_json = canonical_json(upd["evidence_ids"]).decode()
                    s.add(q)
            count = int(s.exec(_QUESTION_COUNT, params={"case_id": key.case_id}).one()) \
                if upd["new_questions"] else 0
        if upd["new_questions"]:
            for text in upd["new_questions"]:
                count += 1
                s.add(Question(case_id=key.case_id, revision=key.revision, ordinal=count,
                               question_id=f"Q{count}", hypothesis_id=account.hypothesis_id,
                               text=text, created_step=key.step_seq))

    # -- 6. execute_tool -----------------------------------------------------------------

    def _execute_tool(self, key: StepKey) -> StageResult:
        with self._tx() as s:
            self._fenced(s, key, "execute_tool")
            if self._output(s, key, "settle_reserve").get("skipped"):
                return self._complete(s, key, "execute_tool", SKIPPED)
            nxt = self._output(s, key, "validate")["decision"]["reply"]["next"]
        if nxt["action"] == "test":
            with self._tx() as s:
                self._fenced(s, key, "execute_tool")
                cfg, _ = self._policy(s, key)
                built = self._output(s, key, "build_context")
                decision = self._output(s, key, "validate")["decision"]
                request = AsyncTestCoordinator(self.store, self.env.feedback_key).hand_off(
                    s, case_id=key.case_id, revision=key.revision, step_seq=key.step_seq,
                    hypothesis_id=int(built["hypothesis_id"]), test=nxt["test"],
                    cost_units=int(decision["cost_units"]),
                    deadline_seconds=cfg.loop.test_deadline_seconds)
                return self._complete(s, key, "execute_tool", {
                    "action": "test", "request_id": request.request_id,
                    "request_path": request.artifact_path,
                    "request_sha256": request.request_sha256})
        if nxt["action"] != "query":
            with self._tx(derived=True) as s:
                self._fenced(s, key, "execute_tool")
                return self._complete(s, key, "execute_tool", {"action": nxt["action"]})
        try:
            result = self.env.router(key.case_id).execute(nxt["operation"], nxt["arguments"])
            data = result.to_json_bytes()
        except ToolError as exc:
            # A runtime failure after a valid plan: recorded as an empty finding with the
            # failure's code, so the reservation is settled like any other result.
            data = _failed_result(nxt, exc.code, exc.message)
        except (ValueError, TypeError, OverflowError, UnicodeError, sqlite3.Error) as exc:
            # The same query on the same snapshot fails the same way every time: record it.
            data = _failed_result(nxt, "TOOL_FAILED", f"{type(exc).__name__}: {exc}"[:500])
        with self._tx() as s:
            self._fenced(s, key, "execute_tool")
            path = ARTIFACT_RAW_RESULT.format(seq=key.step_seq)
            digest = Store.put_artifact(s, key.case_id, path, data)
            return self._complete(s, key, "execute_tool",
                                  {"action": "query", "result_path": path,
                                   "result_sha256": digest})

    def record_tool_stopped(self, key: StepKey, code: str, message: str) -> bool | None:
        """Record the step's query as a failed result (``code``, ``message``) after the
        runtime stopped ``execute_tool`` (a worker time limit): the step then goes on like
        after any tool failure, instead of running the same query into the same limit.

        Returns:
            True when this call recorded ``execute_tool``; None when it was recorded
            before (its stage finished, or another runner recorded it); False when the
            step's action is not a query (the caller parks the case instead).

        Raises:
            StaleStateError: the step is no longer the case's next one.
        """
        with self._tx() as s:
            try:
                self._fenced(s, key, "execute_tool")
            except _AlreadyRecorded:
                return None
            if self._output(s, key, "settle_reserve").get("skipped"):
                return False
            nxt = self._output(s, key, "validate")["decision"]["reply"]["next"]
            if nxt["action"] != "query":
                return False
            path = ARTIFACT_RAW_RESULT.format(seq=key.step_seq)
            digest = Store.put_artifact(s, key.case_id, path,
                                        _failed_result(nxt, code, message))
            self._complete(s, key, "execute_tool", {"action": "query", "result_path": path,
                                                    "result_sha256": digest})
        return True

    # -- 7. record_evidence --------------------------------------------------------------

    def _record_evidence(self, key: StepKey) -> StageResult:
        with self._tx() as s:
            self._fenced(s, key, "record_evidence")
            executed = self._output(s, key, "execute_tool")
            if executed.get("skipped") or executed.get("action") != "query":
                return self._complete(s, key, "record_evidence", SKIPPED)
            built = self._output(s, key, "build_context")
            decision = self._output(s, key, "validate")["decision"]
            art = Store.get_artifact(s, key.case_id, executed["result_path"])
            if art is None or art.sha256 != executed["result_sha256"]:
                raise InvestigationError("RESULT_IDENTITY", "the stored tool result changed")
            hid = int(built["hypothesis_id"])
            ev = EvidenceStore.record(
                s, case_id=key.case_id, revision=key.revision, step_seq=key.step_seq,
                hypothesis_id=hid, result=_loads(art.data),
                cost_units=int(decision["cost_units"]))
            account = self._account(s, key, hid)
            account.pending_evidence_id = ev.evidence_id
            account.no_novelty_streak = 0 if ev.new_item_count > 0 else \
                account.no_novelty_streak + 1
            s.add(account)
            return self._complete(s, key, "record_evidence", {
                "evidence_id": ev.evidence_id, "item_count": ev.item_count,
                "new_item_count": ev.new_item_count, "duplicate": ev.duplicate})

    # -- 8. publish ----------------------------------------------------------------------

    @staticmethod
    def _record_lifecycle(s: Session, key: StepKey, case: CaseRecord,
                          verdict: dict[str, Any], built: dict[str, Any], outcome: str,
                          held: str | None,
                          facts: checkpoints.StepFacts) -> TerminationReason | None:
        """Record the step as a lifecycle round (``loop.lifecycle``); a paused session is
        resumed into its exact prior state for it and paused again."""
        session = lifecycle.load(case)
        if session is None or session.is_terminal:
            return None
        paused = session.state == SessionState.PAUSED
        if paused:
            session.resume()
        decision = verdict.get("decision") or {}
        started = facts.context_created_at  # the step's start: its context's creation
        stop = lifecycle.record_step(
            case, session, accepted=bool(verdict.get("accepted")),
            action=(decision.get("reply") or {}).get("next", {}).get("action"),
            cost_units=int(decision.get("projection", {}).get("reserve_units", 0)),
            started_at=started, all_terminal=outcome == COMPLETED,
            blocked=outcome == BLOCKED and built.get("finalize") is False
            and verdict.get("accepted") is not True)
        if paused and not session.is_terminal and held == CASE_PAUSED:
            session.pause()
        lifecycle.save(case, session)
        return stop

    def _publish(self, key: StepKey) -> StageResult:
        with self._tx() as s:
            case = self._fence(s, key, "publish")
            # An operator hold that arrived during this step is kept on the case but not
            # in the state document: the checkpoint records the investigation only.
            held = case.state if case.state in CASE_HELD else None
            if held is not None:
                case.state = CASE_INVESTIGATING
            cfg, budget = self._policy(s, key)
            built = self._output(s, key, "build_context")
            verdict = self._output(s, key, "validate")
            hid = built.get("hypothesis_id")
            reason: str | None = None
            if built["finalize"]:
                outcome = COMPLETED
            elif not verdict.get("accepted"):
                assert hid is not None
                account = self._account(s, key, int(hid))
                outcome, reason = REJECTED, verdict["code"]
                if account.invalid_streak >= cfg.loop.max_invalid_responses:
                    outcome, reason = BLOCKED, BLOCK_INVALID_LLM_RESPONSES
                    case.state, case.blocked_reason = CASE_BLOCKED, BLOCK_INVALID_LLM_RESPONSES
            elif self._output(s, key, "execute_tool").get("action") == "test":
                # The request is stored; no worker waits for the feedback.
                outcome, reason = BLOCKED, BLOCK_AWAITING_TEST_FEEDBACK
                case.state, case.blocked_reason = CASE_BLOCKED, BLOCK_AWAITING_TEST_FEEDBACK
            else:
                review = verdict["decision"].get("early_diagnosis")
                outcome = DEFERRED if review and review["accepted"] else PROGRESSED
            accounts = self._accounts(s, key)
            for account in accounts:
                budget.apply_automatic_disposition(account)
                s.add(account)
            if outcome != BLOCKED and all(a.status != rules.ACTIVE for a in accounts):
                outcome = COMPLETED
            facts = checkpoints.step_facts(s, key)
            state = checkpoints.state_document(s, key, case, accounts, outcome, reason,
                                               hid, built.get("context_sha256"), facts=facts)
            if built.get("policy_sha256") not in (None, state["policy_sha256"]):
                # The stages took the policy build_context named (decision 127); the store
                # now holds another one: never publish a step under a swapped policy.
                raise InvestigationError(
                    "POLICY_CHANGED",
                    f"the policy of revision {key.revision} changed during step "
                    f"{key.step_seq}", step_seq=key.step_seq)
            if outcome == COMPLETED:
                state["case_state"] = CASE_BUILDING_DIAGNOSIS
            case_state, blocked_reason = state["case_state"], state["blocked_reason"]
            stop = self._record_lifecycle(s, key, case, verdict, built, outcome, held,
                                          facts)
            if held == CASE_CANCELLED:
                case_state = CASE_CANCELLED
            elif held == CASE_PAUSED and outcome != COMPLETED:
                case_state = CASE_PAUSED  # blocked_reason says what a resume restores
            elif stop is not None and outcome != COMPLETED:
                case_state, blocked_reason = CASE_STOPPED, f"SESSION_{stop.value}"
            cp = checkpoints.publish(s, key, case, state, built.get("context_sha256"), hid,
                                     outcome, reason, canonical_json(built).decode(), facts)
            moved = {"head_seq": key.step_seq, "head_hash": cp.hash, "last_outcome": outcome,
                     "last_reason": reason, "retry_not_before": None, "updated_at": utcnow(),
                     "state": case_state, "blocked_reason": blocked_reason,
                     "session_json": case.session_json}
            # The compare-and-set writes the case's pending changes (its session, a hold's
            # state) itself: one Core UPDATE (not flushed first), after which the ORM
            # object takes the written values as committed (what the ORM's "evaluate"
            # synchronisation did), so the commit does not write the row again.
            res = core(s).execute(_CASE_PUBLISH, {"id_": key.case_id,
                                                  "head_": key.step_seq - 1, **moved})
            if res.rowcount != 1:
                raise StaleStateError(f"case {key.case_id} head moved during publish")
            for name, value in moved.items():
                set_committed_value(case, name, value)
            Store.set_pointer(s, key.case_id, POINTER_STATE, cp.state_path,
                              state["_state_sha256"])
            if outcome == COMPLETED:
                write_summary(s, key.case_id, key.revision, self.env.config.limits.currency)
            out = {"outcome": outcome, "reason": reason, "hypothesis_id": hid,
                   "checkpoint_hash": cp.hash}
            self._complete(s, key, "publish", out)
            details = {} if verdict.get("accepted") or built["finalize"] else \
                {"rejection": verdict["code"], "message": verdict["detail"]}
            return StageResult(out, Outcome(outcome, key.case_id, key.step_seq, reason,
                                            hypothesis_id=hid, details=details))
