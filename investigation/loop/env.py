"""What the stages need in one process: store, policy, gateway, package reader, routers."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from sqlalchemy import bindparam
from sqlalchemy import select as sa_select

from investigation.cases.reader import PackageReader
from investigation.cases.registry import load_snapshot
from investigation.cases.snapshot import Snapshot
from investigation.config import InvestigationConfig, canonical_json
from investigation.errors import InvestigationError
from investigation.llm.gateway import LLMGateway
from investigation.loop.checkpoints import ReplayCache
from investigation.store.engine import Store, sha256_hex, table_of
from investigation.store.models import CaseRecord
from investigation.tools import ToolRouter

#: Case ids whose package id a process remembers.
PACKAGE_IDS_KEPT = 4096
_CASES = table_of(CaseRecord).c
_PACKAGE_OF = sa_select(_CASES.package_id).where(_CASES.id == bindparam("id"))


@dataclass
class StageEnv:
    """What the stages need: the store, the policy, the gateway and the package reader.

    Args:
        store: the SQL store.
        config: the investigation config given by the operator (or the defaults).
        gateway_factory: builds the LLM gateway on first use (only ``llm_call`` needs it),
            so a step that resumes after its model call works without provider config.
        reader: the package reader (validation cache shared across steps).
        explicit_config: True when the operator passed ``--config``; a different stored
            policy is then refused instead of adopted.
        snapshot_cache_size: packages whose snapshot and tool router stay open in this
            process (least recently used are closed); cases of the same package share
            them. Default 4.
        feedback_key: the key that derives external-test feedback secrets
            (``docs/async-tests.md``); without it ``test`` actions are refused.
        async_commit: on PostgreSQL, stage transactions that write only what the engine
            can derive again commit without waiting for the disk (decision 126). Default
            True; ignored on SQLite.
    """

    store: Store
    config: InvestigationConfig
    gateway_factory: Callable[[], LLMGateway] | None
    reader: PackageReader
    explicit_config: bool = False
    snapshot_cache_size: int = 4
    feedback_key: bytes | None = None
    async_commit: bool = True

    def __post_init__(self) -> None:
        self._gateway: LLMGateway | None = None
        #: Checkpoint generations validated in this process (``checkpoints.verify_replay``).
        self.replay_cache = ReplayCache()
        #: The operational limits in force, as the replay cache's key.
        self.limits_key = sha256_hex(canonical_json(self.config.limits.model_dump(mode="json")))
        #: Snapshot and router per package id (a package is immutable: its id is its
        #: sha256, so every case of it reads the same snapshot).
        self._routers: OrderedDict[str, tuple[Snapshot, ToolRouter]] = OrderedDict()
        self._packages: OrderedDict[str, str] = OrderedDict()  # case id -> package id

    @property
    def gateway(self) -> LLMGateway:
        if self._gateway is None:
            if self.gateway_factory is None:
                raise InvestigationError(
                    "PROVIDER_CONFIGURATION",
                    "this step needs a model call but no providers are configured; "
                    "pass --providers FILE")
            self._gateway = self.gateway_factory()
        return self._gateway

    def snapshot(self, case_id: str) -> Snapshot:
        """The case's validated package snapshot (a bounded LRU of packages per process)."""
        return self._open(case_id)[0]

    def router(self, case_id: str) -> ToolRouter:
        """The ToolRouter over the case's snapshot (cached per package)."""
        return self._open(case_id)[1]

    def _open(self, case_id: str) -> tuple[Snapshot, ToolRouter]:
        package = self._packages.get(case_id)
        if package is None and self._routers:
            # A case met for the first time: when its package is open already (another
            # case of it), that snapshot serves it; its bytes are not read again.
            row = self.store.read_one(_PACKAGE_OF, {"id": case_id})
            if row is not None and row[0] in self._routers:
                package = self._packages[case_id] = str(row[0])
                while len(self._packages) > PACKAGE_IDS_KEPT:
                    self._packages.popitem(last=False)
        if package is not None and package in self._routers:
            self._routers.move_to_end(package)
            self._packages.move_to_end(case_id)
            return self._routers[package]
        snapshot = load_snapshot(self.store, case_id, self.reader)
        package = snapshot.package_id
        self._packages[case_id] = package
        while len(self._packages) > PACKAGE_IDS_KEPT:
            self._packages.popitem(last=False)
        if package not in self._routers:
            self._routers[package] = (snapshot, ToolRouter(snapshot, self.config.tools))
            while len(self._routers) > max(1, self.snapshot_cache_size):
                _, (_, evicted) = self._routers.popitem(last=False)
                evicted.close()
        self._routers.move_to_end(package)
        return self._routers[package]
