"""The newest schema migration this code knows, without importing Alembic.

The read commands (``status``, ``steps``, ``cases``, ``report``, ...) open an existing
store and check that it is at this revision before they read (``workers.stores``).
Importing Alembic and reading the migration scripts for that check was about a third of
their start (0.3-0.7 s on the 2-core machine). ``migrate.head_revision`` reads the
scripts; a test holds the two equal, so a new migration updates :data:`HEAD_REVISION`.
"""

from __future__ import annotations

#: The id of the newest file under ``investigation/store/migrations/versions``.
HEAD_REVISION = "0013_attempt_guard"
