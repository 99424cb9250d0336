"""External tests handed to humans or automated rigs (``docs/async-tests.md``)."""

from investigation.external_tests.coordinator import (
    DEADLINE_WARNING,
    FEEDBACK_OPERATION,
    AsyncTestCoordinator,
    Feedback,
    derive_secret,
)

__all__ = ["DEADLINE_WARNING", "FEEDBACK_OPERATION", "AsyncTestCoordinator", "Feedback",
           "derive_secret"]
