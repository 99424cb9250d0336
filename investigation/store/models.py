"""SQLModel tables: the single source of truth (DESIGN.md "Storage").

Every mutable investigation fact lives here; Redis holds only queue messages and locks.
Uniqueness constraints carry the idempotency and fencing rules:

* ``stage_run`` (case_id, revision, step_seq, stage): a finished stage is recorded once.
* ``checkpoint`` (case_id, seq): publishing is a compare-and-set on the head.
* ``ledger_entry`` (case_id, revision, hypothesis_id, step_seq, kind): one charge/refund per step.
* ``evidence`` (case_id, evidence_id) and (case_id, revision, step_seq): one record per plan.
* ``artifact`` (case_id, path): exact bytes written once under a logical path; the bytes
  themselves are a ``blob`` (sha256), stored once.

Immutable tables (``IMMUTABLE_TABLES``; and the frozen columns of ``GUARDED_TABLES``)
are protected by the store itself: triggers refuse UPDATE and DELETE (migration
``0007_compact_store``), so a published fact cannot be rewritten by a bug or a stray
statement.

JSON columns hold canonical JSON text (``str``), so rows compare byte for byte across
SQLite and PostgreSQL.
"""

from __future__ import annotations

from datetime import UTC, datetime

from sqlalchemy import BigInteger, Column, Index, LargeBinary, UniqueConstraint, text
from sqlmodel import Field, SQLModel


def utcnow() -> datetime:
    """Timezone-aware now (UTC). Wall-clock times are audit data, never hashed."""
    return datetime.now(UTC)


class PackageRecord(SQLModel, table=True):
    """A validated case package: the ZIP's exact bytes, keyed by their sha256."""

    __tablename__ = "package"
    id: str = Field(primary_key=True, max_length=64)
    size_bytes: int
    manifest_json: str
    data: bytes = Field(sa_column=Column(LargeBinary, nullable=False))
    created_at: datetime = Field(default_factory=utcnow)


class CaseRecord(SQLModel, table=True):
    """A registered case and its current scheduling head."""

    __tablename__ = "case"
    id: str = Field(primary_key=True, max_length=64)
    package_id: str = Field(foreign_key="package.id", max_length=64)
    current_revision: int = 1
    state: str = "INVESTIGATING"
    blocked_reason: str | None = None
    head_seq: int = 0
    head_hash: str | None = None
    last_outcome: str | None = None
    last_reason: str | None = None
    retry_not_before: datetime | None = None
    llm_retry_id: str = ""
    """The operator's current ``retry_id`` (``resume --retry-id``); opens a new LLM operation."""
    objective_json: str | None = None
    """The case's ``ResearchObjective`` record (seed 001; ``docs/lifecycle.md``)."""
    session_json: str | None = None
    """The case's ``InvestigationSession`` record, or ``None`` before its first use."""
    created_at: datetime = Field(default_factory=utcnow)
    updated_at: datetime = Field(default_factory=utcnow)


class RevisionRecord(SQLModel, table=True):
    """An analysis revision: accepted interpretation, hypothesis batch, frozen policy."""

    __tablename__ = "revision"
    __table_args__ = (UniqueConstraint("case_id", "revision"),)
    id: int | None = Field(default=None, primary_key=True)
    case_id: str = Field(foreign_key="case.id", index=True, max_length=64)
    revision: int
    interpretation_json: str
    hypotheses_sha256: str = Field(max_length=64)
    policy_json: str | None = None
    policy_sha256: str | None = Field(default=None, max_length=64)
    created_at: datetime = Field(default_factory=utcnow)


class HypothesisBirth(SQLModel, table=True):
    """Immutable birth record of one accepted hypothesis."""

    __tablename__ = "hypothesis_birth"
    __table_args__ = (UniqueConstraint("case_id", "revision", "hypothesis_id"),)
    id: int | None = Field(default=None, primary_key=True)
    case_id: str = Field(foreign_key="case.id", index=True, max_length=64)
    revision: int
    hypothesis_id: int
    statement: str
    record_json: str
    record_sha256: str = Field(max_length=64)


class BudgetAccount(SQLModel, table=True):
    """One hypothesis's budget account and qualitative state.

    ``status`` is ``active`` or a terminal disposition: ``investigation_finished``,
    ``rejected``, ``exhausted``; ``disposition_reason`` says why (a closing turn's reason,
    ``iteration_cap``/``low_information``/``budget_exhausted``, prefixes the model's).
    """

    __tablename__ = "budget_account"
    __table_args__ = (UniqueConstraint("case_id", "revision", "hypothesis_id"),)
    id: int | None = Field(default=None, primary_key=True)
    case_id: str = Field(foreign_key="case.id", index=True, max_length=64)
    revision: int
    hypothesis_id: int
    credit_units: int
    balance_units: int
    status: str = "active"
    disposition_reason: str | None = None
    confidence: str = "unassessed"
    turns: int = 0
    iterations: int = 0
    invalid_streak: int = 0
    no_novelty_streak: int = 0
    pending_evidence_id: str | None = None
    last_rejection_json: str | None = None
    """The latest rejection ``{"code", "detail", "step_seq"}`` of this hypothesis's replies."""
    deferred_by: int | None = None
    """Hypothesis whose accepted early-diagnosis review deferred this one to assessment-only
    (``docs/early-diagnosis.md``), or ``None``."""
    deferred_step: int | None = None
    """Step whose plan applied that deferral."""


class LedgerEntry(SQLModel, table=True):
    """One budget movement. ``amount_units`` is signed (credit +, reserve -, refund +)."""

    __tablename__ = "ledger_entry"
    __table_args__ = (
        UniqueConstraint("case_id", "revision", "hypothesis_id", "step_seq", "kind"),
        # An account's newest entry (its balance, checked at every step; decision 121).
        Index("ix_ledger_entry_newest", "case_id", "revision", "hypothesis_id", "id"))
    id: int | None = Field(default=None, primary_key=True)
    case_id: str = Field(foreign_key="case.id", index=True, max_length=64)
    revision: int
    hypothesis_id: int
    step_seq: int
    kind: str
    amount_units: int
    balance_after_units: int
    reference: str | None = None


class Artifact(SQLModel, table=True):
    """An artifact: a logical path of a case naming exact bytes by their sha256.

    The bytes live once in :class:`Blob` (content-addressed, compressed, possibly a delta
    of the previous artifact of the same ``kind``); ``investigation.store.blobs`` reads
    them back exactly. Rows are write-once (the store refuses UPDATE and DELETE).
    """

    __tablename__ = "artifact"
    __table_args__ = (UniqueConstraint("case_id", "path"),
                      Index("ix_artifact_lineage", "case_id", "kind", "id"))
    id: int | None = Field(default=None, primary_key=True)
    case_id: str = Field(index=True, max_length=64)
    path: str = Field(max_length=512)
    kind: str = Field(max_length=512)
    """The path with every run of digits replaced by ``*`` (``.../*/context.json``): the
    artifacts of one kind form the lineage a new one is stored as a delta against."""
    sha256: str = Field(max_length=64)
    size_bytes: int
    media_type: str = "application/json"
    created_at: datetime = Field(default_factory=utcnow)


class Blob(SQLModel, table=True):
    """Exact bytes once per sha256, zstandard-compressed (``investigation.store.blobs``).

    ``encoding`` is ``zstd`` (a whole frame) or ``zstd-delta`` (a frame compressed with the
    bytes of blob ``base_sha256`` as its raw-content dictionary); ``depth`` counts the
    deltas down to a whole frame. Rows are write-once.
    """

    __tablename__ = "blob"
    sha256: str = Field(primary_key=True, max_length=64)
    size_bytes: int
    encoding: str = Field(max_length=16)
    base_sha256: str | None = Field(default=None, max_length=64)
    depth: int = 0
    data: bytes = Field(sa_column=Column(LargeBinary, nullable=False))


class ManifestPointer(SQLModel, table=True):
    """Mutable pointers of the case manifest (``investigation_state``, ``investigation_summary``)."""

    __tablename__ = "manifest_pointer"
    __table_args__ = (UniqueConstraint("case_id", "name"),)
    id: int | None = Field(default=None, primary_key=True)
    case_id: str = Field(index=True, max_length=64)
    name: str
    path: str
    sha256: str = Field(max_length=64)


class Checkpoint(SQLModel, table=True):
    """A hash-chained state checkpoint; unique per (case, seq) for fencing."""

    __tablename__ = "checkpoint"
    __table_args__ = (UniqueConstraint("case_id", "seq"),)
    id: int | None = Field(default=None, primary_key=True)
    case_id: str = Field(index=True, max_length=64)
    revision: int
    seq: int
    parent_hash: str | None = Field(default=None, max_length=64)
    hash: str = Field(max_length=64)
    state_path: str
    context_sha256: str | None = Field(default=None, max_length=64)
    hypothesis_id: int | None = None
    outcome: str
    reason: str | None = None
    archive_digest: str | None = Field(default=None, max_length=64)
    """The running archive digest after this generation (``loop.checkpoints``): it binds the
    previous generation's digest and this one's rows and artifact bytes."""
    created_at: datetime = Field(default_factory=utcnow)


class StageRun(SQLModel, table=True):
    """Completion marker and recorded output of one stage of one step."""

    __tablename__ = "stage_run"
    __table_args__ = (UniqueConstraint("case_id", "revision", "step_seq", "stage"),
                      Index("ix_stage_run_stage", "case_id", "stage", "step_seq"))
    id: int | None = Field(default=None, primary_key=True)
    case_id: str = Field(index=True, max_length=64)
    revision: int
    step_seq: int
    stage: str
    output_json: str
    completed_at: datetime = Field(default_factory=utcnow)


class LLMOperation(SQLModel, table=True):
    """One persisted provider operation (all attempts for one model decision)."""

    __tablename__ = "llm_operation"
    __table_args__ = (UniqueConstraint("case_id", "revision", "step_seq", "retry_id"),)
    id: int | None = Field(default=None, primary_key=True)
    case_id: str = Field(index=True, max_length=64)
    revision: int
    step_seq: int
    retry_id: str = ""
    call_index: int
    """Ordinal of this decision call within the case (0-based); scripted replies use it."""
    status: str = "pending"
    """``pending``, ``retry_pending``, ``succeeded``, ``exhausted``, ``failed``."""
    attempts_made: int = 0
    next_provider_index: int = 0
    round_index: int = 0
    retry_not_before: datetime | None = None
    error_code: str | None = None
    error_message: str | None = None
    succeeded_attempt: int | None = None
    response_sha256: str | None = Field(default=None, max_length=64)
    hypothesis_id: int | None = None
    """The hypothesis the decision is for (token and money accounting per hypothesis)."""
    created_at: datetime = Field(default_factory=utcnow)


class LLMAttempt(SQLModel, table=True):
    """One request to one provider; the request is stored before it is sent."""

    __tablename__ = "llm_attempt"
    __table_args__ = (UniqueConstraint("operation_id", "attempt"),)
    id: int | None = Field(default=None, primary_key=True)
    operation_id: int = Field(foreign_key="llm_operation.id", index=True)
    attempt: int
    provider: str
    request_path: str
    request_sha256: str = Field(max_length=64)
    response_path: str | None = None
    response_sha256: str | None = Field(default=None, max_length=64)
    status: str = "sent"
    """``sent``, ``succeeded``, ``failed``."""
    http_status: int | None = None
    error_code: str | None = None
    error_message: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    finish_reason: str | None = Field(default=None, max_length=64)
    reserved_micros: int | None = Field(default=None, sa_type=BigInteger)
    """Money reserved before sending (worst case: prompt estimate plus ``max_tokens``), in
    millionths of ``limits.currency``; ``None``: the provider has no price."""
    cost_micros: int | None = Field(default=None, sa_type=BigInteger)
    """Money the attempt cost (actual usage, else the reservation), once finished."""
    currency: str | None = Field(default=None, max_length=8)
    """The ``limits.currency`` the attempt's money is in (set with ``reserved_micros``;
    ``None``: no price, or priced before migration ``0012_attempt_currency``)."""
    started_at: datetime = Field(default_factory=utcnow)
    finished_at: datetime | None = None


class Plan(SQLModel, table=True):
    """An accepted decision, stored before any effect, bound to its call and context."""

    __tablename__ = "plan"
    __table_args__ = (UniqueConstraint("case_id", "revision", "step_seq"),)
    id: int | None = Field(default=None, primary_key=True)
    case_id: str = Field(index=True, max_length=64)
    revision: int
    step_seq: int
    hypothesis_id: int
    action: str
    operation: str | None = None
    arguments_json: str | None = None
    decision_json: str
    llm_operation_id: int
    llm_attempt: int
    request_sha256: str = Field(max_length=64)
    output_sha256: str = Field(max_length=64)
    context_sha256: str = Field(max_length=64)
    prompt_version: str
    schema_version: str
    plan_path: str
    plan_sha256: str = Field(max_length=64)


class Evidence(SQLModel, table=True):
    """One evidence record with a controller-assigned id (``E1``, ``E2``, ... per case)."""

    __tablename__ = "evidence"
    __table_args__ = (
        UniqueConstraint("case_id", "evidence_id"),
        UniqueConstraint("case_id", "revision", "step_seq"),
        # The records still open to assessment (few at any time): the live-state check
        # reads only these between steps (``loop.live``).
        Index("ix_evidence_open", "case_id", "revision", sqlite_where=text("NOT assessed"),
              postgresql_where=text("NOT assessed")),
        # The newest records of a hypothesis (the context's windows), the newest ordinal,
        # and an earlier record with the same fingerprint (a duplicate): bounded reads.
        Index("ix_evidence_hypothesis", "case_id", "revision", "hypothesis_id", "ordinal"),
        Index("ix_evidence_ordinal", "case_id", "ordinal"),
        Index("ix_evidence_fingerprint", "case_id", "revision", "hypothesis_id",
              "fingerprint"),
    )
    id: int | None = Field(default=None, primary_key=True)
    case_id: str = Field(index=True, max_length=64)
    revision: int
    step_seq: int
    ordinal: int
    evidence_id: str
    hypothesis_id: int
    operation: str
    arguments_json: str
    findings_json: str
    item_keys_json: str
    warnings_json: str
    fingerprint: str = Field(max_length=64)
    item_count: int
    new_item_count: int
    duplicate: bool = False
    cost_units: int
    assessed: bool = False
    assessment_score: int | None = None
    refund_units: int | None = None
    artifact_path: str
    artifact_sha256: str = Field(max_length=64)


class EvidenceKey(SQLModel, table=True):
    """One item key a hypothesis's evidence has found (write-once): the novelty index.

    An item is new for a hypothesis when its key has no row here yet (seed 000, "Budget
    and stopping"), so accounting a result reads only its own keys, not every earlier
    record. ``key_sha256`` is the sha256 of the item's ``key`` (keys are snapshot text of
    any length); ``evidence_id`` names the record that found it first.
    """

    __tablename__ = "evidence_key"
    __table_args__ = (UniqueConstraint("case_id", "revision", "hypothesis_id", "key_sha256"),
                      # A record's rows (the live check counts the newest records' rows).
                      Index("ix_evidence_key_record", "case_id", "evidence_id"))
    id: int | None = Field(default=None, primary_key=True)
    case_id: str = Field(max_length=64)
    revision: int
    hypothesis_id: int
    key_sha256: str = Field(max_length=64)
    evidence_id: str


class HypothesisNote(SQLModel, table=True):
    """One audit note of a hypothesis (``update.note`` of an accepted reply; write-once).

    The context carries the newest ``limits.notes_in_context``; the summary all of them.
    """

    __tablename__ = "hypothesis_note"
    __table_args__ = (UniqueConstraint("case_id", "revision", "hypothesis_id", "step_seq"),
                      # The notes of the steps after a checkpoint (decision 121).
                      Index("ix_hypothesis_note_step", "case_id", "step_seq"))
    id: int | None = Field(default=None, primary_key=True)
    case_id: str = Field(max_length=64)
    revision: int
    hypothesis_id: int
    step_seq: int
    note: str


class Question(SQLModel, table=True):
    """A question record (``Q1``, ``Q2``, ... per case). History is append-only."""

    __tablename__ = "question"
    __table_args__ = (UniqueConstraint("case_id", "question_id"),)
    id: int | None = Field(default=None, primary_key=True)
    case_id: str = Field(index=True, max_length=64)
    revision: int
    ordinal: int
    question_id: str
    hypothesis_id: int
    text: str
    status: str = "open"
    created_step: int
    resolved_step: int | None = None
    resolution_evidence_json: str | None = None


class TestRequest(SQLModel, table=True):
    """An external (human or automated) test handed out by a plan (``docs/async-tests.md``).

    ``status``: ``awaiting`` -> ``submitted`` -> ``confirmed``, or ``expired`` when the
    frozen deadline passed first. Only the sha256 of the per-request feedback secret is
    stored; the exact request is the artifact at ``artifact_path``.
    """

    __tablename__ = "test_request"
    __table_args__ = (UniqueConstraint("case_id", "request_id"),
                      UniqueConstraint("case_id", "revision", "step_seq"))
    __test__ = False  # not a pytest test class
    id: int | None = Field(default=None, primary_key=True)
    case_id: str = Field(foreign_key="case.id", index=True, max_length=64)
    revision: int
    step_seq: int
    hypothesis_id: int
    request_id: str = Field(max_length=16)
    kind: str = Field(max_length=16)
    cost_units: int
    artifact_path: str
    request_sha256: str = Field(max_length=64)
    secret_sha256: str = Field(max_length=64)
    deadline_at: datetime
    status: str = Field(default="awaiting", max_length=16)
    feedback_json: str | None = None
    feedback_sha256: str | None = Field(default=None, max_length=64)
    evidence_id: str | None = Field(default=None, max_length=16)
    created_at: datetime = Field(default_factory=utcnow)
    submitted_at: datetime | None = None
    closed_at: datetime | None = None


class StageDelivery(SQLModel, table=True):
    """Durable delivery counter of one stage of one step (a stage that keeps killing its
    worker is parked: ``investigation/loop/deliveries.py``).

    ``deliveries`` counts every delivery that started while the stage had no marker;
    ``unfinished`` counts those that never returned since the last one that did (a worker
    killed inside the stage). It is reset when a delivery returns and by an operator resume.
    """

    __tablename__ = "stage_delivery"
    __table_args__ = (UniqueConstraint("case_id", "revision", "step_seq", "stage"),)
    id: int | None = Field(default=None, primary_key=True)
    case_id: str = Field(index=True, max_length=64)
    revision: int
    step_seq: int
    stage: str = Field(max_length=32)
    deliveries: int = 0
    unfinished: int = 0
    last_delivered_at: datetime = Field(default_factory=utcnow)
