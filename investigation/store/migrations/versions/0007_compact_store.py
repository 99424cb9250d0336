"""compact store: content-addressed, compressed artifact bytes; archive digests per
checkpoint; guards that refuse UPDATE/DELETE of published rows (issue 13)

Schema:

* ``blob`` (sha256, size, encoding, base, depth, zstd frame); ``artifact`` loses ``data``
  and gains ``kind`` (its lineage) and ``size_bytes``, indexed ``(case_id, kind, id)``.
* ``checkpoint.archive_digest``; indexes ``stage_run (case_id, stage, step_seq)`` and
  ``evidence (case_id, revision) WHERE NOT assessed``.
* the guard triggers of ``investigation.store.guards``.

Data: every artifact's bytes become a blob (a delta of the previous artifact of the same
case and kind, at most 32 deltas per chain, as ``investigation.store.blobs`` writes them),
and every checkpoint gets its archive digest, computed from the stored bytes. An artifact
whose bytes no longer match its recorded sha256 keeps that sha256 (its bytes are stored
under their own), so the replay reports it exactly as before the migration. The
functions below are frozen copies: a later change of the engine's code does not change
what this migration wrote.

Downgrade restores ``artifact.data`` from the blobs and drops the rest.

Revision ID: 0007_compact_store
Revises: 0006_model_usage
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

import sqlalchemy as sa
import sqlmodel
import zstandard
from alembic import op

from investigation.store import guards

revision = '0007_compact_store'
down_revision = '0006_model_usage'
branch_labels = None
depends_on = None

MAX_DELTA_DEPTH = 32
LEVEL = 3
BATCH = 200


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _canonical(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      allow_nan=False).encode("utf-8")


def _dict(base: bytes) -> zstandard.ZstdCompressionDict:
    return zstandard.ZstdCompressionDict(base, dict_type=zstandard.DICT_TYPE_RAWCONTENT)


def _kind(path: str) -> str:
    return re.sub(r"\d+", "*", path)


def _archive_digest(previous: str, case_id: str, cp: Any, shas: dict[str, str],
                    built: str | None) -> str:
    return _sha(_canonical({
        "previous": previous, "case_id": case_id, "seq": cp.seq, "revision": cp.revision,
        "parent_hash": cp.parent_hash, "hash": cp.hash, "state_path": cp.state_path,
        "context_sha256": cp.context_sha256, "hypothesis_id": cp.hypothesis_id,
        "outcome": cp.outcome, "reason": cp.reason,
        "state_artifact": shas.get(cp.state_path),
        "context_artifact": shas.get(f"analysis/investigation/{cp.seq:04d}/context.json"),
        "build_context": built,
    }))


def upgrade() -> None:
    bind = op.get_bind()
    op.create_table(
        'blob',
        sa.Column('sha256', sqlmodel.sql.sqltypes.AutoString(length=64), nullable=False),
        sa.Column('size_bytes', sa.Integer(), nullable=False),
        sa.Column('encoding', sqlmodel.sql.sqltypes.AutoString(length=16), nullable=False),
        sa.Column('base_sha256', sqlmodel.sql.sqltypes.AutoString(length=64), nullable=True),
        sa.Column('depth', sa.Integer(), nullable=False),
        sa.Column('data', sa.LargeBinary(), nullable=False),
        sa.PrimaryKeyConstraint('sha256'),
    )
    with op.batch_alter_table('artifact') as batch:
        batch.add_column(sa.Column('kind', sqlmodel.sql.sqltypes.AutoString(length=512),
                                   nullable=True))
        batch.add_column(sa.Column('size_bytes', sa.Integer(), nullable=True))
    with op.batch_alter_table('checkpoint') as batch:
        batch.add_column(sa.Column('archive_digest',
                                   sqlmodel.sql.sqltypes.AutoString(length=64), nullable=True))
    _move_bytes_to_blobs(bind)
    _fill_archive_digests(bind)
    with op.batch_alter_table('artifact') as batch:
        batch.drop_column('data')
        batch.alter_column('kind', existing_type=sqlmodel.sql.sqltypes.AutoString(length=512),
                           nullable=False)
        batch.alter_column('size_bytes', existing_type=sa.Integer(), nullable=False)
        batch.create_index('ix_artifact_lineage', ['case_id', 'kind', 'id'], unique=False)
    with op.batch_alter_table('stage_run') as batch:
        batch.create_index('ix_stage_run_stage', ['case_id', 'stage', 'step_seq'],
                           unique=False)
    op.create_index('ix_evidence_open', 'evidence', ['case_id', 'revision'], unique=False,
                    sqlite_where=sa.text('NOT assessed'),
                    postgresql_where=sa.text('NOT assessed'))
    guards.create_guards(bind, inserts=False)  # the INSERT guards came with 0009


def _move_bytes_to_blobs(bind: Any) -> None:
    artifact = sa.table('artifact', sa.column('id', sa.Integer), sa.column('case_id'),
                        sa.column('path'), sa.column('sha256'), sa.column('data'),
                        sa.column('kind'), sa.column('size_bytes'))
    blob = sa.table('blob', sa.column('sha256'), sa.column('size_bytes'),
                    sa.column('encoding'), sa.column('base_sha256'), sa.column('depth'),
                    sa.column('data'))
    stored = {r[0]: (r[1], r[2]) for r in bind.execute(
        sa.select(blob.c.sha256, blob.c.depth, blob.c.size_bytes)).all()}
    ids = [r[0] for r in bind.execute(
        sa.select(artifact.c.id).order_by(artifact.c.case_id, artifact.c.id)).all()]
    # (case_id, kind) -> (sha256, bytes, depth) of the newest artifact of that lineage
    lineage: dict[tuple[str, str], tuple[str, bytes, int]] = {}
    for start in range(0, len(ids), BATCH):
        chunk = ids[start:start + BATCH]
        rows = bind.execute(sa.select(artifact.c.id, artifact.c.case_id, artifact.c.path,
                                      artifact.c.sha256, artifact.c.data)
                            .where(artifact.c.id.in_(chunk))
                            .order_by(artifact.c.case_id, artifact.c.id)).all()
        for art_id, case_id, path, recorded, raw in rows:
            data = bytes(raw)
            sha = _sha(data)  # the bytes' own address (== recorded unless damaged)
            kind = _kind(path)
            if sha not in stored:
                base = lineage.get((case_id, kind))
                if base is not None and base[0] != sha and base[2] < MAX_DELTA_DEPTH:
                    frame = zstandard.ZstdCompressor(level=LEVEL, dict_data=_dict(base[1])) \
                        .compress(data)
                    values = {"encoding": "zstd-delta", "base_sha256": base[0],
                              "depth": base[2] + 1}
                else:
                    frame = zstandard.ZstdCompressor(level=LEVEL).compress(data)
                    values = {"encoding": "zstd", "base_sha256": None, "depth": 0}
                bind.execute(blob.insert().values(sha256=sha, size_bytes=len(data),
                                                  data=frame, **values))
                stored[sha] = (values["depth"], len(data))
            if sha == recorded:
                lineage[(case_id, kind)] = (sha, data, stored[sha][0])
            bind.execute(artifact.update().where(artifact.c.id == art_id)
                         .values(kind=kind, size_bytes=len(data)))


def _load(bind: Any, sha: str, memo: dict[str, bytes]) -> bytes | None:
    if sha in memo:
        return memo[sha]
    chain = []
    current: str | None = sha
    while current is not None and current not in memo and len(chain) <= MAX_DELTA_DEPTH + 1:
        row = bind.execute(sa.text("SELECT encoding, base_sha256, data FROM blob "
                                   "WHERE sha256 = :s"), {"s": current}).first()
        if row is None:
            return None
        chain.append((current, row[0], bytes(row[2])))
        current = row[1] if row[0] == "zstd-delta" else None
    data = memo.get(current) if current is not None else None
    for blob_sha, encoding, frame in reversed(chain):
        dictionary = _dict(data) if encoding == "zstd-delta" and data is not None else None
        data = zstandard.ZstdDecompressor(dict_data=dictionary).decompress(frame) \
            if dictionary is not None else zstandard.ZstdDecompressor().decompress(frame)
        memo[blob_sha] = data
    return memo.get(sha)


def _fill_archive_digests(bind: Any) -> None:
    cases = [r[0] for r in bind.execute(sa.text(
        "SELECT DISTINCT case_id FROM checkpoint ORDER BY case_id")).all()]
    for case_id in cases:
        rows = bind.execute(sa.text(
            "SELECT id, seq, revision, parent_hash, hash, state_path, context_sha256, "
            "hypothesis_id, outcome, reason FROM checkpoint WHERE case_id = :c ORDER BY seq"),
            {"c": case_id}).all()
        paths = {r.state_path for r in rows} | {
            f"analysis/investigation/{r.seq:04d}/context.json" for r in rows}
        shas: dict[str, str] = {}
        memo: dict[str, bytes] = {}
        for path, recorded in bind.execute(sa.text(
                "SELECT path, sha256 FROM artifact WHERE case_id = :c ORDER BY id"),
                {"c": case_id}).all():
            if path not in paths:
                continue
            data = _load(bind, recorded, memo)
            if data is not None:  # the bytes the artifact names, hashed again
                shas[path] = _sha(data)
            if len(memo) > 256:
                memo.clear()
        built = {r[0]: _sha(str(r[1]).encode("utf-8", "surrogatepass")) for r in bind.execute(
            sa.text("SELECT step_seq, output_json FROM stage_run WHERE case_id = :c "
                    "AND stage = 'build_context'"), {"c": case_id}).all()}
        digest = ""
        for cp in rows:
            digest = _archive_digest(digest, case_id, cp, shas, built.get(cp.seq))
            bind.execute(sa.text("UPDATE checkpoint SET archive_digest = :d WHERE id = :i"),
                         {"d": digest, "i": cp.id})


def downgrade() -> None:
    bind = op.get_bind()
    guards.drop_guards(bind)
    op.drop_index('ix_evidence_open', table_name='evidence')
    with op.batch_alter_table('stage_run') as batch:
        batch.drop_index('ix_stage_run_stage')
    with op.batch_alter_table('artifact') as batch:
        batch.drop_index('ix_artifact_lineage')
        batch.add_column(sa.Column('data', sa.LargeBinary(), nullable=True))
    memo: dict[str, bytes] = {}
    for art_id, sha in bind.execute(sa.text("SELECT id, sha256 FROM artifact")).all():
        data = _load(bind, sha, memo)
        if len(memo) > 4096:
            memo.clear()
        bind.execute(sa.text("UPDATE artifact SET data = :d WHERE id = :i"),
                     {"d": data if data is not None else b"", "i": art_id})
    with op.batch_alter_table('artifact') as batch:
        batch.alter_column('data', existing_type=sa.LargeBinary(), nullable=False)
        batch.drop_column('size_bytes')
        batch.drop_column('kind')
    with op.batch_alter_table('checkpoint') as batch:
        batch.drop_column('archive_digest')
    op.drop_table('blob')
