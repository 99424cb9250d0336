"""The shared text index: built once per package, verified, shared by processes, bounded."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from investigation.cases.builder import package_bytes
from investigation.cases.reader import PackageReader, PackageSnapshot
from investigation.cases.snapshot import DictSnapshot
from investigation.cases.textindex import (
    INDEX_FORMAT,
    LiveTextIndex,
    MappedTextIndex,
    TextIndexStore,
)
from investigation.config import ToolLimits
from investigation.tools import ToolRouter
from tests.search_reference import ReferenceRouter

REPO = Path(__file__).resolve().parents[2]
SOURCE = {
    "app.py": b"def foo():\n    return 1\n",
    "img.png": b"\x89PNG\x00foo",
    "lib/util.py": b"FOO = 'foo'\r\nbar = FOO\r\n",
    "notes.txt": b"no final newline foo",
    "empty.txt": b"",
}
LOGS = {"app.log": b"ERROR foo\nINFO ok\n"}
CALLS = [
    ("source.search", {"pattern": "foo"}),
    ("source.search", {"pattern": r"^\w+ = ", "regex": True}),
    ("symbol.occurrences", {"symbol": "FOO"}),
    ("logs.search", {"pattern": "ERROR"}),
]


def package(source: dict[str, bytes] | None = None) -> bytes:
    files = {"report.md": b"report\n"}
    files.update({"source/" + p: d for p, d in (source or SOURCE).items()})
    files.update({"logs/" + p: d for p, d in LOGS.items()})
    return package_bytes(files, [], has_logs=True)[0]


def open_snapshot(data: bytes, directory: Path | None, **kwargs: int) -> PackageSnapshot:
    return PackageReader(text_index_dir=directory, **kwargs).read(data)


def assert_results_match_reference(snapshot: PackageSnapshot,
                                   source: dict[str, bytes] | None = None) -> None:
    limits = ToolLimits(search_timeout_s=600.0)
    reference = ReferenceRouter(DictSnapshot(source or SOURCE, logs=LOGS), limits)
    router = ToolRouter(snapshot, limits)
    for operation, arguments in CALLS:
        assert router.execute(operation, arguments).to_json_bytes() == \
            reference.execute(operation, arguments).to_json_bytes()


def index_files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if not p.name.endswith(".lock"))


def test_index_is_built_once_and_reused(tmp_path: Path) -> None:
    data = package()
    first = open_snapshot(data, tmp_path)
    index = first.text_index()
    assert isinstance(index, MappedTextIndex)
    assert index.path.name == f"{first.package_id}.v{INDEX_FORMAT}.idx"
    assert index_files(tmp_path) == [index.path.name]  # no temporary file left
    inode = index.path.stat().st_ino
    assert_results_match_reference(first)
    again = open_snapshot(data, tmp_path)  # another reader: opens, does not rebuild
    assert again.text_index() is not None
    assert index.path.stat().st_ino == inode
    assert_results_match_reference(again)


def test_another_process_maps_the_same_file(tmp_path: Path) -> None:
    data = package()
    snapshot = open_snapshot(data, tmp_path)
    index = snapshot.text_index()
    assert index is not None
    inode = index.path.stat().st_ino
    (tmp_path / "pkg.zip").write_bytes(data)
    code = (
        "import sys\n"
        "from investigation.cases.reader import PackageReader\n"
        "from investigation.config import ToolLimits\n"
        "from investigation.tools import ToolRouter\n"
        f"snap = PackageReader(text_index_dir={str(tmp_path)!r}).read("
        f"open({str(tmp_path / 'pkg.zip')!r}, 'rb').read())\n"
        "index = snap.text_index()\n"
        "result = ToolRouter(snap, ToolLimits()).execute('source.search', {'pattern': 'foo'})\n"
        "print(index.path.stat().st_ino, len(result.items))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                         text=True, timeout=120, check=True)
    child_inode, items = out.stdout.split()
    assert int(child_inode) == inode
    assert int(items) == 3


def test_concurrent_builders_leave_one_valid_index(tmp_path: Path) -> None:
    data = package()
    (tmp_path / "pkg.zip").write_bytes(data)
    directory = tmp_path / "index"
    code = (
        "from investigation.cases.reader import PackageReader\n"
        f"snap = PackageReader(text_index_dir={str(directory)!r}).read("
        f"open({str(tmp_path / 'pkg.zip')!r}, 'rb').read())\n"
        "print(snap.text_index() is not None)\n"
    )
    procs = [subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE,
                              text=True) for _ in range(4)]
    outputs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert outputs == ["True"] * 4
    assert [p.returncode for p in procs] == [0] * 4
    assert len(index_files(directory)) == 1
    assert_results_match_reference(open_snapshot(data, directory))


@pytest.mark.parametrize("damage", ["flip-content", "truncate", "footer", "other-package"])
def test_a_damaged_index_is_rebuilt(tmp_path: Path, damage: str) -> None:
    data = package()
    index = open_snapshot(data, tmp_path).text_index()
    assert index is not None
    raw = bytearray(index.path.read_bytes())
    if damage == "flip-content":
        raw[5] ^= 0x01
    elif damage == "truncate":
        raw = raw[: len(raw) // 2]
    elif damage == "footer":
        raw[-40] ^= 0xFF
    else:  # a valid index of another package under this package's name
        other = open_snapshot(package({"x.py": b"x\n"}), tmp_path).text_index()
        assert other is not None
        raw = bytearray(other.path.read_bytes())
    index.close()
    index.path.write_bytes(bytes(raw))
    rebuilt = open_snapshot(data, tmp_path)
    fresh = rebuilt.text_index()
    assert fresh is not None
    assert fresh.path.read_bytes() != bytes(raw)
    assert_results_match_reference(rebuilt)


def test_directory_bound_evicts_least_recently_opened(tmp_path: Path) -> None:
    first = open_snapshot(package(), tmp_path)
    index = first.text_index()
    assert index is not None
    size = index.path.stat().st_size
    bound = size + size // 2  # room for one index of this size, not two
    old = time.time() - 100
    os.utime(index.path, (old, old))
    other_source = dict(SOURCE, **{"extra.py": b"x = 1\n"})
    second = open_snapshot(package(other_source), tmp_path, text_index_bytes=bound)
    assert second.text_index() is not None
    assert index_files(tmp_path) == [f"{second.package_id}.v{INDEX_FORMAT}.idx"]
    assert_results_match_reference(first)  # the evicted file stays usable while open
    assert_results_match_reference(second, other_source)


def test_text_over_the_bound_gets_no_index(tmp_path: Path) -> None:
    snapshot = open_snapshot(package(), tmp_path, text_index_bytes=100)
    assert snapshot.text_index() is None
    assert index_files(tmp_path) == []
    assert_results_match_reference(snapshot)  # read from the package itself


def test_unusable_directory_falls_back_to_the_package(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_bytes(b"not a directory")
    snapshot = open_snapshot(package(), blocker / "index")
    assert snapshot.text_index() is None
    assert_results_match_reference(snapshot)


def test_stale_temporary_files_are_removed(tmp_path: Path) -> None:
    stale = tmp_path / ".dead.tmp"
    stale.write_bytes(b"x")
    old = time.time() - 7200
    os.utime(stale, (old, old))
    fresh = tmp_path / ".building.tmp"
    fresh.write_bytes(b"x")
    assert open_snapshot(package(), tmp_path).text_index() is not None
    assert not stale.exists()
    assert fresh.exists()  # may belong to a builder still running


def test_a_search_unmaps_the_index(tmp_path: Path) -> None:
    snapshot = open_snapshot(package(), tmp_path)
    index = snapshot.text_index()
    assert index is not None
    ToolRouter(snapshot, ToolLimits()).execute("source.search", {"pattern": "foo"})
    maps = Path("/proc/self/maps")
    if maps.exists():
        assert str(index.path) not in maps.read_text()


def test_snapshots_without_an_index_read_themselves() -> None:
    snapshot = open_snapshot(package(), None)
    assert snapshot.text_index() is None
    router = ToolRouter(DictSnapshot(SOURCE, logs=LOGS), ToolLimits())
    assert isinstance(router._text_index(), LiveTextIndex)


def test_store_path_and_empty_text(tmp_path: Path) -> None:
    store = TextIndexStore(tmp_path)
    only_binary = {"a.bin": b"\x00"}
    snapshot = DictSnapshot(only_binary, package_id="f" * 64)
    index = store.open(snapshot)
    assert index is not None and index.path == store.path_for("f" * 64)
    with index.view() as view:
        assert view.locate("source", "a.bin") is None
