"""The error tree of the investigation engine.

Every failure that an operator or an upstream system can see carries a stable
``code`` (upper snake case). Codes are part of the public contract: tests, scripts
and dashboards match on them, never on messages.

::

    InvestigationError                  unsafe input, stale state, exceeded limits
    ├── PackageError                    a case package failed validation (PKG_*)
    ├── ToolError                       a snapshot operation refused its arguments (TOOL_*)
    ├── StoreError                      the store refused a write (STORE_*)
    │   └── StaleStateError             a fenced write lost against a newer head (STALE_STATE)
    ├── ConfigError                     a configuration file is broken (CONFIG_*)
    ├── LifecycleError                  a session transition or lifecycle record was refused
    │                                   (LIFECYCLE_*)
    └── ProviderError                   a model provider failed (classified once, at the gateway)
        ├── TransientProviderError      retry later; carries ``retry_after_s``
        ├── ProviderCredentialsError    HTTP 401/403 (PROVIDER_CREDENTIALS)
        ├── ProviderConfigurationError  4xx other than 408/409/429, bad dialect, script end
        └── ProviderRequestRejected     the provider can never accept this request (too large)
    LockBusy                            a duplicate concurrent dispatch (not an InvestigationError)

``LockBusy`` is raised without blocking when another dispatch holds the case lock.
"""

from __future__ import annotations

from typing import Any


class InvestigationError(Exception):
    """A controlled failure with a stable code.

    Args:
        code: stable upper-snake-case code, e.g. ``"PKG_PATH_TRAVERSAL"``.
        message: human-readable explanation that tells the operator how to fix it.
        details: JSON-compatible extra facts (never secrets or snapshot contents).
    """

    code: str = "INVESTIGATION_ERROR"

    def __init__(self, code: str, message: str, **details: Any) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.details = details

    def to_dict(self) -> dict[str, Any]:
        """Return ``{"code", "message", "details"}`` for JSON output."""
        return {"code": self.code, "message": self.message, "details": self.details}


class PackageError(InvestigationError):
    """A case package is malformed or exceeds a configured limit (codes ``PKG_*``)."""


class ToolError(InvestigationError):
    """A snapshot operation refused its arguments or hit a hard bound (codes ``TOOL_*``)."""


class ConfigError(InvestigationError):
    """A configuration file or value is invalid (codes ``CONFIG_*``)."""


class LifecycleError(InvestigationError):
    """A lifecycle transition, usage record or serialised record was refused (``LIFECYCLE_*``).

    Raised before any change: the session is exactly as it was. The codes are listed in
    ``investigation.lifecycle.codes`` and in ``docs/lifecycle.md``.
    """


class StoreError(InvestigationError):
    """The store refused an operation (codes ``STORE_*``)."""


class StaleStateError(StoreError):
    """A fenced write lost: the case head moved past the writer's expected position."""

    def __init__(self, message: str, **details: Any) -> None:
        super().__init__("STALE_STATE", message, **details)


class ProviderError(InvestigationError):
    """A model provider failed. Subclasses say what the gateway does about it."""


class TransientProviderError(ProviderError):
    """Worth retrying later (timeouts, connection errors, 408/409/429/5xx, bad bytes).

    Args:
        retry_after_s: the provider's own ``Retry-After`` hint in seconds, if any.
    """

    def __init__(self, code: str, message: str, retry_after_s: float | None = None,
                 **details: Any) -> None:
        super().__init__(code, message, **details)
        self.retry_after_s = retry_after_s


class ProviderCredentialsError(ProviderError):
    """HTTP 401/403 or a missing API key variable; blocks with ``PROVIDER_CREDENTIALS``."""


class ProviderConfigurationError(ProviderError):
    """A request the provider rejects as misconfigured; blocks with ``PROVIDER_CONFIGURATION``."""


class ProviderRequestRejected(ProviderError):
    """The provider can never accept this exact request (e.g. HTTP 413, context too long)."""


class LockBusy(Exception):
    """Another dispatch holds the per-case lock; raised at once, never after waiting.

    Args:
        case_id: the case whose lock is held.
        expires_in_s: seconds left of the holder's lease (Redis lock), if known: a live
            holder renews it at every stage; the lease of a worker that died runs out,
            and the recovery sweep then dispatches the case.
        holder: the holding process (``name@host pid N``), if the lease names it.
        renewed_s_ago: seconds since the holder took or last renewed the lease, if known.
    """

    code = "LOCK_BUSY"

    def __init__(self, case_id: str, expires_in_s: float | None = None,
                 holder: str | None = None, renewed_s_ago: float | None = None) -> None:
        self.holder = holder
        self.renewed_s_ago = renewed_s_ago
        held = "" if holder is None else f"; held by {holder}" + (
            "" if renewed_s_ago is None else f", renewed {renewed_s_ago:g} s ago")
        lease = held + ("" if expires_in_s is None else (
            f"; its lease runs out in {max(1, round(expires_in_s))} s unless its holder "
            "renews it (a running stage does; if the holding worker died, the recovery "
            f"sweep dispatches the case after that, or `investigate dispatch {case_id} "
            "--take-over` does now)"))
        super().__init__(
            f"LOCK_BUSY: case {case_id} is already being dispatched (a worker, the recovery "
            f"sweep or another `run` holds its lock{lease}); nothing to do: `investigate "
            f"status {case_id}` shows its progress")
        self.case_id = case_id
        self.expires_in_s = expires_in_s
