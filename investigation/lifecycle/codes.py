"""Stable error codes of the lifecycle (all raised as ``LifecycleError``).

Codes are part of the public contract: callers match on them, never on messages.
"""

from __future__ import annotations

#: The requested edge is not in the seed's state diagram (including any edge out of a
#: terminal state: COMPLETED, FAILED and CANCELLED are absorbing).
INVALID_TRANSITION = "LIFECYCLE_INVALID_TRANSITION"
#: A paused session may only resume to the exact active state it was paused from.
RESUME_MISMATCH = "LIFECYCLE_RESUME_MISMATCH"
#: A transition to COMPLETED, FAILED or CANCELLED (or a terminal record) without a reason.
REASON_REQUIRED = "LIFECYCLE_REASON_REQUIRED"
#: A termination reason given to (or stored with) an active or PAUSED state.
REASON_FORBIDDEN = "LIFECYCLE_REASON_FORBIDDEN"
#: The reason belongs to another terminal state (e.g. ``USER_CANCELLED`` with COMPLETED).
REASON_STATE_MISMATCH = "LIFECYCLE_REASON_STATE_MISMATCH"
#: PLANNING -> EXECUTING while a budget dimension is exhausted.
BUDGET_EXHAUSTED = "LIFECYCLE_BUDGET_EXHAUSTED"
#: Usage recorded on, or a decision asked for, a session in a terminal state.
SESSION_TERMINAL = "LIFECYCLE_SESSION_TERMINAL"
#: A PAUSED record without the prior active state.
PAUSED_WITHOUT_PRIOR = "LIFECYCLE_PAUSED_WITHOUT_PRIOR"
#: A prior state recorded on a record that is not PAUSED.
PRIOR_WITHOUT_PAUSE = "LIFECYCLE_PRIOR_WITHOUT_PAUSE"
#: The recorded prior state is not one of PLANNING, EXECUTING, EVALUATING, UPDATING.
INVALID_PRIOR_STATE = "LIFECYCLE_INVALID_PRIOR_STATE"
#: A state name that is not a ``SessionState``.
UNKNOWN_STATE = "LIFECYCLE_UNKNOWN_STATE"
#: A reason name that is not a ``TerminationReason``.
UNKNOWN_REASON = "LIFECYCLE_UNKNOWN_REASON"
#: A timestamp without a timezone (constructing, transitioning or loading).
NAIVE_TIMESTAMP = "LIFECYCLE_NAIVE_TIMESTAMP"
#: A timestamp that is not an ISO 8601 string / ``datetime``.
INVALID_TIMESTAMP = "LIFECYCLE_INVALID_TIMESTAMP"
#: ``updated_at`` earlier than ``created_at``.
TIMESTAMP_ORDER = "LIFECYCLE_TIMESTAMP_ORDER"
#: Not a JSON object, a missing or unknown key, or a value of the wrong JSON type.
MALFORMED_RECORD = "LIFECYCLE_MALFORMED_RECORD"
#: The record's ``format`` is not one this code reads.
UNSUPPORTED_FORMAT = "LIFECYCLE_UNSUPPORTED_FORMAT"
#: A value of the right type outside its domain (empty id, negative bound, NaN, ...).
INVALID_VALUE = "LIFECYCLE_INVALID_VALUE"
#: Objective metadata that is not JSON-compatible (or nested deeper than allowed).
INVALID_METADATA = "LIFECYCLE_INVALID_METADATA"

ALL_CODES = (
    INVALID_TRANSITION,
    RESUME_MISMATCH,
    REASON_REQUIRED,
    REASON_FORBIDDEN,
    REASON_STATE_MISMATCH,
    BUDGET_EXHAUSTED,
    SESSION_TERMINAL,
    PAUSED_WITHOUT_PRIOR,
    PRIOR_WITHOUT_PAUSE,
    INVALID_PRIOR_STATE,
    UNKNOWN_STATE,
    UNKNOWN_REASON,
    NAIVE_TIMESTAMP,
    INVALID_TIMESTAMP,
    TIMESTAMP_ORDER,
    MALFORMED_RECORD,
    UNSUPPORTED_FORMAT,
    INVALID_VALUE,
    INVALID_METADATA,
)
