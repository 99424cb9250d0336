"""Build workers/demo_case/demo.sqlite: the pre-migration backup of a small help-centre database.

Deterministic, stdlib sqlite3 only: no timestamps, no randomness. Run it with
`python workers/demo_case/make_db.py [OUTPUT]` (default: demo.sqlite next to this file).

What it contains, and why it matters to the bug (see NOTES.md):

* ``articles`` is a *rowid table* (no PRIMARY KEY), created the way
  ``sqlite_utils`` 3.35 creates a table from ``insert_all()`` without ``pk=``.
  Twelve articles were inserted (rowids 1..12), then four were retired
  (deleted), so the live rowids have gaps: 1, 2, 5, 6, 7, 9, 11, 12.
* ``articles_fts`` is an FTS5 *external-content* index over title/body with
  ``content=[articles]``, created exactly as ``Table.enable_fts()`` in 3.35 does
  (no triggers) and then rebuilt, as ``Table.rebuild_fts()`` does, after the
  deletions: the index is keyed by the rowids of ``articles``.
* ``_migrations`` records the application's schema migrations applied so far;
  0007 (the column reorder that runs ``table.transform()``) is not in it yet,
  because this file is the backup taken just before 0007 ran.
"""

import pathlib
import sqlite3
import sys

ARTICLES = [
    # (slug, title, body, category) inserted in this order: rowid 1..12
    (
        "getting-started",
        "Getting started with Parcelly",
        "Create an account, add your first shipping address and connect a store.",
        "basics",
    ),
    (
        "change-password",
        "Changing your password",
        "Open Settings, choose Security and pick a new password of at least twelve characters.",
        "account",
    ),
    (
        "legacy-api-keys",
        "Legacy API keys",
        "Version one API keys stop working at the end of the year; create a new key instead.",
        "developers",
    ),
    (
        "fax-support",
        "Sending labels by fax",
        "Fax delivery of shipping labels has been discontinued.",
        "labels",
    ),
    (
        "print-labels",
        "Printing shipping labels",
        "Labels print on A6 thermal paper; choose the printer under Settings, Labels.",
        "labels",
    ),
    (
        "track-parcel",
        "Tracking a parcel",
        "Every shipment gets a tracking link that is emailed to the recipient.",
        "shipping",
    ),
    (
        "refunds",
        "How refunds are processed",
        "A refund for an unused label is credited to your balance within five working days.",
        "billing",
    ),
    (
        "holiday-rates",
        "Holiday surcharge rates",
        "Carriers add a surcharge between November and January.",
        "billing",
    ),
    (
        "customs-forms",
        "Customs forms for international parcels",
        "International parcels outside the EU need a CN22 or CN23 customs declaration.",
        "shipping",
    ),
    (
        "beta-dashboard",
        "The beta dashboard",
        "The beta dashboard has become the default dashboard.",
        "basics",
    ),
    (
        "two-factor",
        "Resetting two-factor authentication",
        "If you lost your phone, ask an account owner to reset two-factor authentication.",
        "account",
    ),
    (
        "invoices",
        "Downloading invoices",
        "Monthly invoices are available as PDF under Billing, Invoices.",
        "billing",
    ),
]

# Articles retired before the backup was taken (by slug), leaving rowid gaps.
RETIRED = ["legacy-api-keys", "fax-support", "holiday-rates", "beta-dashboard"]

MIGRATIONS = [
    ("0001_create_articles", "2023-06-05 09:00:00"),
    ("0002_add_category", "2023-06-12 09:00:00"),
    ("0003_enable_fts", "2023-07-03 09:00:00"),
    ("0004_seed_billing_articles", "2023-07-24 09:00:00"),
    ("0005_retire_legacy_articles", "2023-08-28 09:00:00"),
    ("0006_rebuild_fts", "2023-08-28 09:05:00"),
]


def build(path: pathlib.Path) -> None:
    if path.exists():
        path.unlink()
    conn = sqlite3.connect(str(path))
    try:
        conn.execute("PRAGMA page_size = 4096")
        conn.execute("PRAGMA journal_mode = DELETE")
        # As sqlite_utils 3.35 creates it from insert_all() without pk=: a rowid table.
        conn.execute(
            "CREATE TABLE [articles] (\n"
            "   [slug] TEXT,\n"
            "   [title] TEXT,\n"
            "   [body] TEXT,\n"
            "   [category] TEXT\n"
            ")"
        )
        conn.executemany(
            "INSERT INTO [articles] ([slug], [title], [body], [category]) VALUES (?, ?, ?, ?)",
            ARTICLES,
        )
        conn.executemany("DELETE FROM [articles] WHERE [slug] = ?", [(slug,) for slug in RETIRED])
        # As Table.enable_fts(["title", "body"]) in 3.35 creates it (FTS5, no triggers).
        conn.execute(
            "CREATE VIRTUAL TABLE [articles_fts] USING FTS5 (\n"
            "    [title], [body],\n"
            "    content=[articles]\n"
            ")"
        )
        # As Table.rebuild_fts() does: re-read every row of the content table by rowid.
        conn.execute("INSERT INTO [articles_fts] ([articles_fts]) VALUES ('rebuild')")
        conn.execute(
            "CREATE TABLE [_migrations] (\n"
            "   [name] TEXT PRIMARY KEY,\n"
            "   [applied_at] TEXT NOT NULL\n"
            ")"
        )
        conn.executemany("INSERT INTO [_migrations] VALUES (?, ?)", MIGRATIONS)
        conn.commit()
        # No VACUUM here: VACUUM may renumber the rowids of a table that has no
        # INTEGER PRIMARY KEY, which would erase the gaps this snapshot must keep.
    finally:
        conn.close()


def main(argv: list[str]) -> int:
    out = (
        pathlib.Path(argv[1]) if len(argv) > 1 else pathlib.Path(__file__).with_name("demo.sqlite")
    )
    build(out)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
