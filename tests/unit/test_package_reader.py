"""Tests of PackageReader: raw ZIP validation, manifest checks, caching and the snapshot."""

from __future__ import annotations

import hashlib
import json
import struct
import threading
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from investigation.cases.builder import build_package, package_bytes
from investigation.cases.reader import PackageReader, PackageSnapshot
from investigation.cases.snapshot import Snapshot
from investigation.config import PackageLimits, canonical_json
from investigation.constants import PACKAGE_FORMAT
from investigation.errors import PackageError

SQLITE = b"SQLite format 3\x00" + bytes(84)


# -- a hand-written ZIP writer with full control over every field -----------------------------


@dataclass
class Entry:
    name: bytes
    data: bytes = b""
    method: int = 0
    mode: int = 0o100644
    flags: int = 0
    declared_size: int | None = None  # overrides the uncompressed size in both headers
    local_name: bytes | None = None  # overrides the name in the local header


def craft(entries: list[Entry], extra_central: list[tuple[Entry, int]] | None = None,
          comment: bytes = b"", prefix: bytes = b"") -> bytes:
    """Write a ZIP; ``extra_central`` adds central records pointing at ``entries[i]``."""
    out = bytearray(prefix)
    records: list[tuple[Entry, int, int, int, int]] = []
    for entry in entries:
        payload = entry.data
        if entry.method == 8:
            packer = zlib.compressobj(9, zlib.DEFLATED, -15)
            payload = packer.compress(entry.data) + packer.flush()
        crc = zlib.crc32(entry.data)
        usize = len(entry.data) if entry.declared_size is None else entry.declared_size
        offset = len(out)
        local_name = entry.name if entry.local_name is None else entry.local_name
        out += struct.pack("<4sHHHHHIIIHH", b"PK\x03\x04", 20, entry.flags, entry.method, 0,
                           0x21, crc, len(payload), usize, len(local_name), 0)
        out += local_name + payload
        records.append((entry, offset, crc, len(payload), usize))
    for extra, index in extra_central or []:
        _, offset, crc, csize, usize = records[index]
        records.append((extra, offset, crc, csize, usize))
    central = bytearray()
    for entry, offset, crc, csize, usize in records:
        central += struct.pack("<4sBBHHHHHIIIHHHHHII", b"PK\x01\x02", 20, 3, 20, entry.flags,
                               entry.method, 0, 0x21, crc, csize, usize, len(entry.name), 0,
                               0, 0, 0, entry.mode << 16, offset)
        central += entry.name
    cd_offset = len(out)
    out += central
    out += struct.pack("<4sHHHHIIH", b"PK\x05\x06", 0, 0, len(records), len(records),
                       len(central), cd_offset, len(comment)) + comment
    return bytes(out)


def manifest_for(files: dict[str, bytes], overrides: dict[str, Any] | None = None) -> bytes:
    manifest: dict[str, Any] = {
        "format": PACKAGE_FORMAT, "report": "report.md", "source_root": "source/",
        "databases": sorted(n[3:] for n in files if n.startswith("db/")),
        "logs_root": "logs/" if any(n.startswith("logs/") for n in files) else None,
        "files": [{"path": n, "sha256": hashlib.sha256(d).hexdigest(), "size": len(d)}
                  for n, d in sorted(files.items())],
    }
    manifest.update(overrides or {})
    return canonical_json(manifest)


BASE = {"report.md": b"# Bug\nIt breaks.\n", "source/a.py": b"print('a')\n"}


def package(extra: list[Entry] | None = None, files: dict[str, bytes] | None = None,
            overrides: dict[str, Any] | None = None) -> bytes:
    """A crafted package whose manifest lists ``files`` (default BASE) plus ``extra``."""
    files = dict(BASE if files is None else files)
    entries = [Entry(n.encode(), d, method=8) for n, d in sorted(files.items())]
    entries += extra or []
    listed = {**files, **{e.name.decode("utf-8", "replace"): e.data for e in extra or []
                          if not e.name.endswith(b"/")}}
    return craft([Entry(b"manifest.json", manifest_for(listed, overrides)),
                  *entries])


def code_of(data: bytes, limits: PackageLimits | None = None) -> str:
    with pytest.raises(PackageError) as err:
        PackageReader(limits or PackageLimits()).read(data)
    return err.value.code


# -- acceptance ------------------------------------------------------------------------------


def test_crafted_package_is_accepted_and_serves_exact_bytes() -> None:
    files = {**BASE, "db/app.sqlite": SQLITE, "logs/x/app.log": b"ERR\n",
             "source/pkg/\u00e9t\u00e9.py": b"\x00\xffbinary"}
    data = package(files=files, extra=[Entry(b"source/pkg/", mode=0o40755)])
    snap = PackageReader().read(data)
    assert isinstance(snap, Snapshot)
    assert snap.package_id == hashlib.sha256(data).hexdigest()
    assert snap.source_paths() == ["a.py", "pkg/\u00e9t\u00e9.py"]
    assert snap.read_source("pkg/\u00e9t\u00e9.py") == b"\x00\xffbinary"
    assert snap.db_names() == ["app.sqlite"]
    assert snap.db_bytes("app.sqlite") == SQLITE
    assert snap.log_paths() == ["x/app.log"]
    assert snap.read_log("x/app.log") == b"ERR\n"
    assert snap.report_text() == "# Bug\nIt breaks.\n"
    assert snap.manifest["format"] == PACKAGE_FORMAT
    for missing in (lambda: snap.read_source("nope"), lambda: snap.db_bytes("a.py"),
                    lambda: snap.read_log("../report.md"), lambda: snap.read_source("../report.md")):
        with pytest.raises(KeyError):
            missing()


def test_built_package_round_trips(tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "lib").mkdir(parents=True)
    (src / "lib/m.py").write_bytes(b"A = 1\r\nB = 2\n")
    (tmp_path / "r.md").write_text("report", encoding="utf-8")
    info = build_package(src, tmp_path / "r.md", tmp_path / "p.zip")
    reader = PackageReader(PackageLimits())
    snap = reader.read((tmp_path / "p.zip").read_bytes())
    assert isinstance(snap, PackageSnapshot)
    assert snap.package_id == info.package_id
    assert snap.read_source("lib/m.py") == b"A = 1\r\nB = 2\n"
    assert snap.read_source("lib/m.py") is snap.read_source("lib/m.py")  # entry cache


def test_validation_cache_is_bounded_and_keyed_by_hash_and_limits() -> None:
    reader = PackageReader(PackageLimits(cache_entries=2))
    packages = [package(files={**BASE, "source/n.py": str(i).encode()}) for i in range(3)]
    ids = [reader.read(p).package_id for p in packages]
    assert reader.cached_ids() == ids[1:]
    reader.read(packages[1])
    assert reader.cached_ids() == [ids[2], ids[1]]
    # The same bytes under tighter limits are validated again, not served from a cache.
    with pytest.raises(PackageError) as err:
        PackageReader(PackageLimits(max_entries=2)).read(packages[0])
    assert err.value.code == "PKG_TOO_MANY_ENTRIES"
    assert PackageReader(PackageLimits(cache_entries=0)).read(packages[0]).package_id == ids[0]


def test_reader_is_thread_safe() -> None:
    reader = PackageReader(PackageLimits(cache_entries=1))
    data = package()
    errors: list[BaseException] = []

    def work() -> None:
        try:
            for _ in range(20):
                assert reader.read(data).read_source("a.py") == b"print('a')\n"
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


# -- hostile archives ------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "code"), [
    (b"source/../x", "PKG_PATH_TRAVERSAL"),
    (b"../x", "PKG_PATH_TRAVERSAL"),
    (b"/etc/passwd", "PKG_ABSOLUTE_PATH"),
    (b"C:/windows/x", "PKG_ABSOLUTE_PATH"),
    (b"source\\..\\x", "PKG_BAD_NAME"),
    (b"source/a\\b.py", "PKG_BAD_NAME"),
    (b"source//x", "PKG_BAD_NAME"),
    (b"source/./x", "PKG_BAD_NAME"),
    (b"source/x\x00.py", "PKG_BAD_NAME"),
    (b"source/x\n.py", "PKG_BAD_NAME"),
    (b"source/\xff.py", "PKG_BAD_NAME"),
    (b"source/" + b"a" * 2000, "PKG_NAME_TOO_LONG"),
    (b"source/" + b"a" * 256 + b"/x.py", "PKG_NAME_TOO_LONG"),
    (b"source/" + "\u00e9".encode() * 128 + b".py", "PKG_NAME_TOO_LONG"),
    (b"source/" + b"a/" * 63 + b"x.py", "PKG_PATH_TOO_DEEP"),
    (b"source/x\x1b[2J.py", "PKG_BAD_NAME"),
    (b"source/x\xc2\x9b.py", "PKG_BAD_NAME"),
    ("source/evil\u202etxt.exe".encode(), "PKG_BAD_NAME"),
    ("source/a\u200bb.py".encode(), "PKG_BAD_NAME"),
    ("source/a\u2066b.py".encode(), "PKG_BAD_NAME"),
    ("source/\U000e0041.py".encode(), "PKG_BAD_NAME"),
    ("source/\ufeffa.py".encode(), "PKG_BAD_NAME"),
])
def test_hostile_names(name: bytes, code: str) -> None:
    assert code_of(package(extra=[Entry(name, b"x")])) == code


def test_name_limits_are_configurable() -> None:
    deep = b"source/" + b"a/" * 62 + b"x.py"  # 64 segments: the default limit
    PackageReader().validate(package(extra=[Entry(deep, b"x")]))
    limits = PackageLimits(max_path_depth=10, max_segment_bytes=13)  # manifest.json
    for name, code in [(b"source/" + b"a/" * 9 + b"x", "PKG_PATH_TOO_DEEP"),
                       (b"source/" + b"a" * 14, "PKG_NAME_TOO_LONG")]:
        with pytest.raises(PackageError) as err:
            PackageReader(limits).validate(package(extra=[Entry(name, b"x")]))
        assert err.value.code == code
        assert "package.max_" in err.value.message


def test_a_refused_name_is_shown_escaped() -> None:
    """The error message (printed to the operator's terminal) never carries the name's
    control or bidirectional characters themselves."""
    with pytest.raises(PackageError) as err:
        PackageReader().validate(package(extra=[Entry("source/\x1b]0;pwned\x07\u202e.py"
                                                      .encode(), b"x")]))
    assert err.value.code == "PKG_BAD_NAME"
    assert "\x1b" not in err.value.message and "\u202e" not in err.value.message
    assert "\\x1b]0;pwned" in err.value.message and "U+001B" in err.value.message
    # escaped once: one backslash per escape, as the name is shown in details too
    assert "'source/\\x1b]0;pwned\\x07\\u202e.py'" in err.value.message, err.value.message
    assert "\\\\" not in err.value.message


def _prefix_conflicts(files: list[str], directories: list[str]) -> bool:
    """The former quadratic rule, kept as the test oracle: every prefix of every name."""
    from investigation.cases.layout import name_key

    keys = [name_key(f) for f in files]
    if len(set(keys)) != len(keys):
        return True
    dirs = {name_key(d) for d in directories}
    for name in files + directories:
        parts = name_key(name).split("/")
        dirs.update("/".join(parts[:depth]) for depth in range(1, len(parts)))
    return any(k in dirs for k in keys)


_SEGMENT = st.sampled_from(["a", "A", "b", "a-b", "a.b", "a b", "\u00e9", "e\u0301", "\u00c9",
                            "a!", "a0"])
_PATH = st.lists(_SEGMENT, min_size=1, max_size=4).map("/".join)


@settings(max_examples=400, deadline=None)
@given(files=st.lists(_PATH, max_size=8), directories=st.lists(_PATH, max_size=3))
def test_conflict_check_agrees_with_every_prefix(files: list[str],
                                                 directories: list[str]) -> None:
    from investigation.cases.layout import check_no_conflicts

    try:
        check_no_conflicts(files, directories)
        refused = False
    except PackageError as exc:
        assert exc.code == "PKG_DUPLICATE_ENTRY"
        refused = True
    assert refused == _prefix_conflicts(files, directories)


def _deep_package(count: int, name_bytes: int) -> bytes:
    files = {"report.md": b"r\n"}
    for i in range(count):
        head = f"source/{i}/"
        files[head + "a/" * ((name_bytes - len(head) - 1) // 2) + "f"] = b""
    return package_bytes(files, [], False)[0]


def test_validation_memory_is_linear_in_the_names() -> None:
    """Issue 10.2: 19,990 entries named ``source/<i>/a/a/.../f`` (1,000 bytes each) took
    6.3 GB to validate, because every prefix of every name was kept. With the depth limit
    raised out of the way, 300 such names must validate within a small multiple of the
    archive's own size (the quadratic rule needed about 100 MB here)."""
    import tracemalloc

    data = _deep_package(300, 1000)
    reader = PackageReader(PackageLimits(max_path_depth=1000), entry_cache_bytes=0)
    tracemalloc.start()
    try:
        reader.validate(data)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 10 * len(data), (peak, len(data))


def test_symlink_entry() -> None:
    data = package(extra=[Entry(b"source/link", b"/etc/passwd", mode=0o120777)])
    assert code_of(data) == "PKG_SYMLINK"


def test_special_file_entry() -> None:
    assert code_of(package(extra=[Entry(b"source/fifo", mode=0o010644)])) == (
        "PKG_UNSUPPORTED_ENTRY_TYPE")


@pytest.mark.parametrize("second", [b"source/a.py", b"source/A.PY", b"source/a.py/"])
def test_duplicate_entries(second: bytes) -> None:
    mode = 0o40755 if second.endswith(b"/") else 0o100644
    assert code_of(package(extra=[Entry(second, b"", mode=mode)])) == "PKG_DUPLICATE_ENTRY"


def test_directory_entry_must_look_like_one() -> None:
    assert code_of(package(extra=[Entry(b"source/d/", b"")])) == "PKG_UNSUPPORTED_ENTRY_TYPE"
    assert code_of(package(extra=[Entry(b"source/d/", b"data", mode=0o40755)])) == (
        "PKG_UNSUPPORTED_ENTRY_TYPE")


def test_duplicate_after_unicode_normalisation() -> None:
    composed, decomposed = "source/\u00e9.py", "source/e\u0301.py"
    files = {**BASE, composed: b"1", decomposed: b"2"}
    assert code_of(package(files=files)) == "PKG_DUPLICATE_ENTRY"


def test_file_used_as_directory() -> None:
    files = {**BASE, "source/a.py/b.py": b"x"}
    assert code_of(package(files=files)) == "PKG_DUPLICATE_ENTRY"


def test_two_central_records_for_one_local_header() -> None:
    files = [Entry(b"manifest.json", manifest_for(BASE)),
             *[Entry(n.encode(), d) for n, d in sorted(BASE.items())]]
    data = craft(files, extra_central=[(Entry(b"source/b.py"), 2)])
    assert code_of(data) == "PKG_OVERLAPPING_ENTRIES"


def test_local_header_name_must_match() -> None:
    data = package(extra=[Entry(b"source/ok.py", b"x", local_name=b"../evil.py")])
    assert code_of(data) == "PKG_LOCAL_HEADER_MISMATCH"


def test_zip_bomb_ratio() -> None:
    data = package(extra=[Entry(b"source/bomb.txt", bytes(4 << 20), method=8)])
    assert code_of(data) == "PKG_COMPRESSION_RATIO"


def test_size_limits() -> None:
    big = package(extra=[Entry(b"source/big.txt", b"y" * 5000)])
    assert code_of(big, PackageLimits(max_entry_bytes=4000)) == "PKG_ENTRY_TOO_LARGE"
    assert code_of(big, PackageLimits(max_total_bytes=5010)) == "PKG_TOO_LARGE"


def test_declared_size_lie_is_caught() -> None:
    # The data inflates to more than declared; the reader stops at declared + 1 byte.
    entries = [Entry(n.encode(), d, method=8) for n, d in sorted(BASE.items())]
    entries.append(Entry(b"source/lie.txt", b"z" * 1000, method=8, declared_size=10))
    listed = {**BASE, "source/lie.txt": b"z" * 10}
    crafted = craft([Entry(b"manifest.json", manifest_for(listed)), *entries])
    assert code_of(crafted) == "PKG_CORRUPT"


def test_too_many_entries() -> None:
    extra = [Entry(f"source/f{i}.py".encode(), b"") for i in range(10)]
    assert code_of(package(extra=extra), PackageLimits(max_entries=5)) == "PKG_TOO_MANY_ENTRIES"


def test_encrypted_and_unsupported_compression() -> None:
    assert code_of(package(extra=[Entry(b"source/e.py", b"x", flags=1)])) == "PKG_ENCRYPTED"
    assert code_of(package(extra=[Entry(b"source/b.py", b"x", method=12)])) == (
        "PKG_UNSUPPORTED_COMPRESSION")


@pytest.mark.parametrize("blob", [b"", b"hello world", b"PK\x03\x04" + bytes(100),
                                  b"%PDF-1.4\n" + bytes(4000)])
def test_not_a_zip(blob: bytes) -> None:
    assert code_of(blob) == "PKG_NOT_ZIP"


def test_hidden_data() -> None:
    assert code_of(craft([Entry(b"manifest.json", manifest_for({}))], comment=b"hi")) == (
        "PKG_HIDDEN_DATA")
    good = package()
    assert code_of(b"MZ-prefix" + good) in {"PKG_HIDDEN_DATA", "PKG_NOT_ZIP"}
    assert code_of(craft([Entry(b"report.md", b"r")], prefix=b"junk")) == "PKG_HIDDEN_DATA"


def test_zip64_and_multidisk_are_refused() -> None:
    good = bytearray(package())
    eocd = good.rfind(b"PK\x05\x06")
    multi = bytearray(good)
    struct.pack_into("<H", multi, eocd + 4, 1)
    assert code_of(bytes(multi)) == "PKG_UNSUPPORTED_ZIP"
    z64 = bytearray(good)
    struct.pack_into("<I", z64, eocd + 16, 0xFFFFFFFF)
    assert code_of(bytes(z64)) == "PKG_UNSUPPORTED_ZIP"


def test_crc_mismatch() -> None:
    # Flip one byte of a stored entry's data after the headers were written.
    raw = craft([Entry(b"manifest.json", manifest_for({**BASE, "source/s.txt": b"abc"})),
                 *[Entry(n.encode(), d) for n, d in sorted(BASE.items())],
                 Entry(b"source/s.txt", b"abc")])
    data = bytearray(raw)
    at = data.find(b"abc", data.find(b"source/s.txt") + 12)
    data[at] = ord("x")
    assert code_of(bytes(data)) == "PKG_CRC_MISMATCH"


# -- manifest --------------------------------------------------------------------------------


def test_manifest_missing() -> None:
    data = craft([Entry(n.encode(), d) for n, d in sorted(BASE.items())])
    assert code_of(data) == "PKG_MANIFEST_MISSING"


@pytest.mark.parametrize("overrides", [
    {"format": "investigation-case/0"},
    {"files": "nope"},
    {"source_root": "src/"},
    {"report": "source/a.py"},
    {"databases": ["../x.sqlite"]},
])
def test_manifest_invalid(overrides: dict[str, Any]) -> None:
    assert code_of(package(overrides=overrides)) == "PKG_MANIFEST_INVALID"


def test_a_manifest_without_logs_root_reads_as_null() -> None:
    """The shape check allowed the key to be absent and the layout check then raised a
    bare KeyError: a traceback and exit 1 from `case add` (a hostile-input trial)."""
    files = dict(BASE)
    manifest = json.loads(manifest_for(files))
    del manifest["logs_root"]
    data = craft([Entry(b"manifest.json", canonical_json(manifest)),
                  *[Entry(n.encode(), d, method=8) for n, d in sorted(files.items())]])
    assert PackageReader(PackageLimits()).read(data)
    logs = {**files, "logs/app.log": b"x\n"}  # logs without a logs root: refused, with a code
    manifest = json.loads(manifest_for(logs))
    del manifest["logs_root"]
    data = craft([Entry(b"manifest.json", canonical_json(manifest)),
                  *[Entry(n.encode(), d, method=8) for n, d in sorted(logs.items())]])
    assert code_of(data) == "PKG_MANIFEST_INVALID"


def test_a_manifest_is_bounded_by_its_entries_before_it_is_parsed() -> None:
    """Values beyond what the archive's entries need are refused before parsing: a 25 MB
    manifest of six million empty lists took 1 GB in every process that opened the
    package (a hostile-input trial). Strings do not count, whatever they hold."""
    padded = package(overrides={"pad": [[]] * 200})
    with pytest.raises(PackageError) as err:
        PackageReader(PackageLimits()).read(padded)
    assert err.value.code == "PKG_MANIFEST_INVALID"
    assert "JSON values, more than the 31 that 3 archive entries need" in err.value.message
    many = {f"source/m{i}.py": b"x" for i in range(300)}
    assert PackageReader(PackageLimits()).read(package(files={**BASE, **many}))
    quoted = {"source/a.py": b"x", "report.md": b"# Bug\n", "source/a[{,,,,,,,,,b.py": b"y"}
    assert PackageReader(PackageLimits()).read(package(files=quoted))


@pytest.mark.timeout(60)
def test_a_manifest_of_unterminated_strings_is_refused_in_linear_time() -> None:
    """The value count's string pattern once needed a closing quote: '"' then many '\\"'
    made every quote scan to the end again (80 KB took 17 s, 1 MB about 45 minutes; a
    review). 4 MB is now one scan."""
    data = craft([Entry(b"manifest.json", b'"' + b'\\"' * (2 << 20)),
                  *[Entry(n.encode(), d) for n, d in sorted(BASE.items())]])
    assert code_of(data) == "PKG_MANIFEST_INVALID"


def test_a_lone_surrogate_in_the_manifest_is_a_manifest_error() -> None:
    """`"extra_key": "\\ud800"` in manifest.json escaped the reader as a raw
    UnicodeEncodeError (INPUT_INVALID from `case add`, blaming the command line; a
    hostile-input trial)."""
    manifest = manifest_for(dict(BASE)).replace(b"{", b'{"extra_key": "\\ud800", ', 1)
    data = craft([Entry(b"manifest.json", manifest),
                  *[Entry(n.encode(), d) for n, d in sorted(BASE.items())]])
    with pytest.raises(PackageError) as err:
        PackageReader(PackageLimits()).read(data)
    assert err.value.code == "PKG_MANIFEST_INVALID"
    assert "lone UTF-16 surrogate" in err.value.message


@pytest.mark.parametrize("number", [b"1e999", b"-1e999", b"1E+400"])
def test_a_manifest_number_beyond_any_float_is_a_manifest_error(number: bytes) -> None:
    """`"note": 1e999` parsed as infinity and escaped as a ValueError: CONFIG_INVALID,
    blaming the INVESTIGATE_* settings (a hostile-input trial)."""
    manifest = manifest_for(dict(BASE)).replace(b"{", b'{"note": ' + number + b", ", 1)
    data = craft([Entry(b"manifest.json", manifest),
                  *[Entry(n.encode(), d) for n, d in sorted(BASE.items())]])
    with pytest.raises(PackageError) as err:
        PackageReader(PackageLimits()).read(data)
    assert err.value.code == "PKG_MANIFEST_INVALID"
    assert f"number {number.decode()} is out of range" in err.value.message


def test_manifest_not_json() -> None:
    data = craft([Entry(b"manifest.json", b"{not json"),
                  *[Entry(n.encode(), d) for n, d in sorted(BASE.items())]])
    assert code_of(data) == "PKG_MANIFEST_INVALID"


def test_entry_outside_layout() -> None:
    assert code_of(package(files={**BASE, "evil.sh": b"rm -rf /"})) == "PKG_MANIFEST_INVALID"


def test_manifest_mismatch() -> None:
    # Listed sha256 differs from the entry's bytes.
    listed = {**BASE, "source/a.py": b"print('b')\n"}
    data = craft([Entry(b"manifest.json", manifest_for(listed)),
                  *[Entry(n.encode(), d) for n, d in sorted(BASE.items())]])
    assert code_of(data) == "PKG_MANIFEST_MISMATCH"
    # An entry that the manifest does not list.
    data = craft([Entry(b"manifest.json", manifest_for(BASE)),
                  *[Entry(n.encode(), d) for n, d in sorted(BASE.items())],
                  Entry(b"source/extra.py", b"x")])
    assert code_of(data) == "PKG_MANIFEST_MISMATCH"
    # A listed file that is absent.
    data = craft([Entry(b"manifest.json", manifest_for({**BASE, "source/gone.py": b"g"})),
                  *[Entry(n.encode(), d) for n, d in sorted(BASE.items())]])
    assert code_of(data) == "PKG_MANIFEST_MISMATCH"


def test_db_entry_must_be_sqlite() -> None:
    assert code_of(package(files={**BASE, "db/x.sqlite": b"nope"})) == "PKG_DB_NOT_SQLITE"


def test_report_must_be_utf8() -> None:
    assert code_of(package(files={**BASE, "report.md": b"\xff\xfe"})) == "PKG_REPORT_INVALID"


def test_package_bytes_output_is_accepted() -> None:
    data, manifest = package_bytes({"report.md": b"r", "source/x.py": b"x"}, [], False)
    snap = PackageReader().read(data)
    assert dict(snap.manifest) == manifest
    assert snap.log_paths() == []


class _Unseekable:
    """A write-only stream: zipfile then writes data descriptors (flag bit 3)."""

    def __init__(self) -> None:
        self.buffer = bytearray()

    def write(self, data: bytes) -> int:
        self.buffer += data
        return len(data)

    def flush(self) -> None:
        pass


def test_data_descriptors_from_a_streaming_writer_are_accepted() -> None:
    stream = _Unseekable()
    with zipfile.ZipFile(stream, "w", zipfile.ZIP_DEFLATED) as archive:  # type: ignore[arg-type]
        archive.writestr("manifest.json", manifest_for(BASE))
        for name, content in sorted(BASE.items()):
            archive.writestr(name, content)
    data = bytes(stream.buffer)
    assert struct.unpack_from("<H", data, 6)[0] & 0x08
    assert PackageReader().read(data).read_source("a.py") == b"print('a')\n"
    # A descriptor that disagrees with the central directory is refused.
    tampered = bytearray(data)
    at = tampered.find(b"PK\x07\x08")
    tampered[at + 4] ^= 0xFF
    assert code_of(bytes(tampered)) == "PKG_LOCAL_HEADER_MISMATCH"


def test_data_hidden_in_an_extra_field_is_refused(tmp_path: Path) -> None:
    import io
    import zipfile

    from investigation.cases.reader import PackageReader
    from investigation.config import PackageLimits
    from investigation.errors import PackageError

    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        info = zipfile.ZipInfo("manifest.json")
        info.extra = b"\xfe\xca" + (60000).to_bytes(2, "little") + b"\x00" * 60000
        zf.writestr(info, "{}")
    with pytest.raises(PackageError) as err:
        PackageReader(PackageLimits()).read(buf.getvalue())
    assert err.value.code == "PKG_HIDDEN_DATA"
