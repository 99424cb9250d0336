"""Names and patterns shared across the engine: one place for every key and path."""

from __future__ import annotations

import re

#: Prompt/contract version written into every context and plan. ``investigation-v1``
#: (before early diagnosis) and ``investigation-v2`` (before the per-turn reply schema,
#: the turn header and rejected replies sent back as turns) stay the names of
#: historical requests and plans.
PROMPT_VERSION = "investigation-v3"
#: Version of the reply JSON schema (see ``investigation.loop.contract``); ``reply-v2``
#: adds the optional ``next.early_diagnosis`` of a ``finish``.
REPLY_SCHEMA_VERSION = "reply-v2"
#: Case package manifest format.
PACKAGE_FORMAT = "investigation-case/1"

#: Logical artifact paths (seed 000, "Persistence and recovery").
ARTIFACT_STEP_DIR = "analysis/investigation/{seq:04d}"
ARTIFACT_CONTEXT = ARTIFACT_STEP_DIR + "/context.json"
#: The per-turn reply schema built from that context (``loop.reply_schema``).
ARTIFACT_REPLY_SCHEMA = ARTIFACT_STEP_DIR + "/reply-schema.json"
ARTIFACT_REQUEST = ARTIFACT_STEP_DIR + "/llm/{operation}/attempt-{attempt:02d}.request.json"
ARTIFACT_RESPONSE = ARTIFACT_STEP_DIR + "/llm/{operation}/attempt-{attempt:02d}.response"
ARTIFACT_PLAN = ARTIFACT_STEP_DIR + "/plan.json"
ARTIFACT_RAW_RESULT = ARTIFACT_STEP_DIR + "/result.json"
ARTIFACT_EVIDENCE = ARTIFACT_STEP_DIR + "/evidence.json"
ARTIFACT_TEST_REQUEST = ARTIFACT_STEP_DIR + "/test-request.json"
ARTIFACT_STATE = ARTIFACT_STEP_DIR + "/state.json"
ARTIFACT_SUMMARY = "analysis/investigation/summary.md"
#: Manifest pointer names.
POINTER_STATE = "investigation_state"
POINTER_SUMMARY = "investigation_summary"

#: The eight stages of one step, in order (DESIGN.md "One step, eight stages").
STAGES = (
    "build_context",
    "llm_call",
    "validate",
    "persist_plan",
    "settle_reserve",
    "execute_tool",
    "record_evidence",
    "publish",
)

#: What a case id may look like where it names a file, a Redis key or a broker message's
#: case (registered ids are ``case-`` + 16 hex digits; anything else never becomes a path).
SAFE_CASE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")
#: :data:`SAFE_CASE_ID` in words, for the errors that refuse a string as a case id.
CASE_ID_RULE = "1-64 letters, digits, '-' and '_', starting with a letter or digit"

#: Redis key patterns and Celery names.
REDIS_LOCK_KEY = "investigation:lock:{case_id}"
#: Celery beat's heartbeat for a queue (``workers.beat``), read by ``investigate health``.
REDIS_BEAT_KEY = "investigation:beat:{queue}"
CELERY_QUEUE = "cases"
TASK_PREFIX = "investigation."
#: The upstream message contract (``docs/message-contract.md``): task
#: ``investigation.dispatch``, args ``[case_id]`` or ``[case_id, max_steps]``, kwargs
#: ``{"contract": 1}`` (optional; a message without it is version 1).
DISPATCH_TASK = TASK_PREFIX + "dispatch"
DISPATCH_CONTRACT_VERSION = 1

#: Scheduling outcomes.
PROGRESSED = "PROGRESSED"
REJECTED = "REJECTED"
YIELDED = "YIELDED"
RETRY_PENDING = "RETRY_PENDING"
DEFERRED = "DEFERRED"
BLOCKED = "BLOCKED"
COMPLETED = "COMPLETED"
OUTCOMES = (PROGRESSED, REJECTED, YIELDED, RETRY_PENDING, DEFERRED, BLOCKED, COMPLETED)
#: Outcomes after which a dispatch goes on with the next step (``DEFERRED``: a step whose
#: accepted early-diagnosis review deferred alternatives to assessment-only).
CONTINUING = (PROGRESSED, REJECTED, DEFERRED)
#: Not a step outcome: the last outcome a case row shows when a worker's stage stopped its
#: step with a controlled error (reason: the error code); nothing of the step was published.
STEP_ERROR = "ERROR"

#: Case states.
CASE_INVESTIGATING = "INVESTIGATING"
CASE_BLOCKED = "BLOCKED"
CASE_BUILDING_DIAGNOSIS = "BUILDING_DIAGNOSIS"
#: Operator holds and stops (``docs/lifecycle.md``): a paused case resumes where it
#: stopped; cancelled and stopped (a lifecycle budget bound) are terminal.
CASE_PAUSED = "PAUSED"
CASE_CANCELLED = "CANCELLED"
CASE_STOPPED = "STOPPED"
#: Case states in which no new stage starts (the one running finishes and is kept).
CASE_HELD = (CASE_PAUSED, CASE_CANCELLED)

#: Blocked reasons.
BLOCK_INVALID_LLM_RESPONSES = "INVALID_LLM_RESPONSES"
BLOCK_PROVIDER_EXHAUSTED = "PROVIDER_EXHAUSTED"
BLOCK_PROVIDER_CONFIGURATION = "PROVIDER_CONFIGURATION"
BLOCK_PROVIDER_CREDENTIALS = "PROVIDER_CREDENTIALS"
BLOCK_AWAITING_TEST_FEEDBACK = "AWAITING_TEST_FEEDBACK"
#: A stage was delivered too often without returning: it keeps killing its worker.
BLOCK_STAGE_POISONED = "STAGE_POISONED"
#: The case's model spending reached ``limits.max_model_cost`` (``llm.spend``).
BLOCK_MODEL_COST_CAP = "MODEL_COST_CAP"
#: A worker time limit (Celery's soft or hard ``--time-limit``) stopped a stage that
#: cannot be recorded as a failed result (any stage but a query's ``execute_tool``).
BLOCK_STAGE_TIME_LIMIT = "STAGE_TIME_LIMIT"

#: Confidence labels, lowest to highest for scheduling (see docs/investigation-loop.md).
CONFIDENCE_ORDER = ("weakened", "unassessed", "weak", "plausible", "supported", "strongly_supported")

#: Snapshot operations (DESIGN.md "Fixed interfaces").
OPERATIONS = (
    "source.list",
    "source.search",
    "source.read",
    "symbol.occurrences",
    "db.tables",
    "db.schema",
    "db.query",
    "logs.search",
)
