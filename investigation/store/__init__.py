"""SQL store: tables and the ``Store`` facade."""

from investigation.store.engine import (
    Store,
    is_lost_race,
    is_serialization_failure,
    is_unique_violation,
    make_engine,
    sha256_hex,
)

__all__ = ["Store", "is_lost_race", "is_serialization_failure", "is_unique_violation",
           "make_engine", "sha256_hex"]
