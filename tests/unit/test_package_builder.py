"""Tests of the deterministic case package builder (investigation.cases.builder)."""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from investigation.cases.builder import build_package
from investigation.cases.reader import PackageReader
from investigation.config import PackageLimits
from investigation.constants import PACKAGE_FORMAT
from investigation.errors import PackageError


def _tree(root: Path, files: dict[str, bytes]) -> Path:
    for rel, content in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)
    return root


@pytest.fixture
def inputs(tmp_path: Path) -> dict[str, Path]:
    source = _tree(tmp_path / "src", {
        "app/main.py": b"def main():\n    return 1\n",
        "app/util.py": b"X = 2\n",
        "README.md": "caf\u00e9\n".encode(),
        "empty.txt": b"",
    })
    report = tmp_path / "bug.txt"
    report.write_text("The app crashes on start.\n", encoding="utf-8")
    db = tmp_path / "app.db"
    with sqlite3.connect(db) as conn:
        conn.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, v TEXT)")
        conn.execute("INSERT INTO t (v) VALUES ('x')")
    conn.close()
    logs = _tree(tmp_path / "logs", {"app.log": b"ERROR boom\n", "sub/worker.log": b"ok\n"})
    return {"source": source, "report": report, "db": db, "logs": logs}


def _names(data: bytes) -> list[str]:
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        return archive.namelist()


def test_build_is_deterministic_and_readable(inputs: dict[str, Path], tmp_path: Path) -> None:
    first = build_package(inputs["source"], inputs["report"], tmp_path / "a.zip",
                          db=inputs["db"], logs=inputs["logs"])
    os.utime(inputs["source"] / "app/main.py", (1_000_000, 1_000_000))
    second = build_package(inputs["source"], inputs["report"], tmp_path / "out/b.zip",
                           db=inputs["db"], logs=inputs["logs"])
    a, b = (tmp_path / "a.zip").read_bytes(), (tmp_path / "out/b.zip").read_bytes()
    assert a == b
    assert first.package_id == second.package_id == hashlib.sha256(a).hexdigest()
    assert first.size_bytes == len(a)
    assert first.file_count == 8  # report + 4 source + 1 db + 2 logs

    names = _names(a)
    assert names == sorted(names)
    with zipfile.ZipFile(io.BytesIO(a)) as archive:
        for info in archive.infolist():
            assert info.date_time == (1980, 1, 1, 0, 0, 0)
            assert info.external_attr >> 16 == 0o100644

    manifest = json.loads(zipfile.ZipFile(io.BytesIO(a)).read("manifest.json"))
    assert manifest["format"] == PACKAGE_FORMAT
    assert manifest["report"] == "report.md"
    assert manifest["source_root"] == "source/"
    assert manifest["databases"] == ["app.sqlite"]
    assert manifest["logs_root"] == "logs/"
    assert [f["path"] for f in manifest["files"]] == sorted(n for n in names
                                                             if n != "manifest.json")

    snap = PackageReader(PackageLimits()).read(a)
    assert snap.source_paths() == ["README.md", "app/main.py", "app/util.py", "empty.txt"]
    assert snap.read_source("README.md") == "caf\u00e9\n".encode()
    assert snap.read_source("empty.txt") == b""
    assert snap.db_names() == ["app.sqlite"]
    assert snap.db_bytes("app.sqlite") == inputs["db"].read_bytes()
    assert snap.log_paths() == ["app.log", "sub/worker.log"]
    assert snap.report_text() == "The app crashes on start.\n"


def test_vcs_metadata_and_output_are_excluded(inputs: dict[str, Path], tmp_path: Path) -> None:
    source = inputs["source"]
    _tree(source, {
        ".hg/store/data": b"hg", ".svn/entries": b"svn", "sub/.git": b"gitdir: ../x\n",
        "pkg/.svn/wc.db": b"x", ".gitignore": b"*.tmp\n",
    })
    out = source / "case.zip"
    build_package(source, inputs["report"], out)
    again = build_package(source, inputs["report"], out)  # the old output is not packed
    names = _names(out.read_bytes())
    assert not [n for n in names if any(p in (".git", ".hg", ".svn") for p in n.split("/"))]
    assert "source/case.zip" not in names
    assert "source/.gitignore" in names  # not a git checkout: a plain walk packs it
    assert again.file_count == 6


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
def test_git_checkout_honours_gitignore(inputs: dict[str, Path], tmp_path: Path) -> None:
    source = inputs["source"]
    _tree(source, {".gitignore": b"*.tmp\nbuild/\n", "scratch.tmp": b"x",
                   "build/out.bin": b"y", "new_untracked.py": b"z = 1\n"})
    env = {**os.environ, "GIT_CONFIG_NOSYSTEM": "1", "HOME": str(tmp_path)}
    git = ["git", "-C", str(source), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True, env=env)
    subprocess.run([*git, "add", "app", "README.md", ".gitignore", "empty.txt"], check=True,
                   env=env)
    subprocess.run([*git, "commit", "-q", "-m", "init"], check=True, env=env)
    assert (source / ".git").is_dir()
    info = build_package(source, inputs["report"], tmp_path / "g.zip")
    names = _names((tmp_path / "g.zip").read_bytes())
    sources = sorted(n.removeprefix("source/") for n in names if n.startswith("source/"))
    assert sources == [".gitignore", "README.md", "app/main.py", "app/util.py", "empty.txt",
                       "new_untracked.py"]
    assert info.file_count == 7


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
def test_a_folder_inside_a_checkout_honours_the_checkouts_gitignore(
        inputs: dict[str, Path], tmp_path: Path) -> None:
    """`--source proj/shop` packed `cart.pyc` that proj/.gitignore ignores, while
    `--source proj` left it out (a new user's trial)."""
    project = _tree(tmp_path / "proj", {".gitignore": b"*.pyc\n",
                                        "shop/cart.py": b"TOTAL = 1\n",
                                        "shop/cart.pyc": b"\x00compiled",
                                        "shop/new.py": b"N = 2\n",
                                        "other/x.py": b"X = 3\n"})
    env = {**os.environ, "GIT_CONFIG_NOSYSTEM": "1", "HOME": str(tmp_path)}
    git = ["git", "-C", str(project), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True, env=env)
    subprocess.run([*git, "add", ".gitignore", "shop/cart.py", "other"], check=True, env=env)
    subprocess.run([*git, "commit", "-q", "-m", "init"], check=True, env=env)
    build_package(project / "shop", inputs["report"], tmp_path / "sub.zip")
    names = _names((tmp_path / "sub.zip").read_bytes())
    assert sorted(n for n in names if n.startswith("source/")) == [
        "source/cart.py", "source/new.py"]  # tracked and untracked, not the ignored .pyc
    # A folder the checkout ignores as a whole: git lists nothing, so it is walked.
    ignored = _tree(project / "vendor", {"lib.py": b"L = 1\n"})
    (project / ".gitignore").write_bytes(b"*.pyc\nvendor/\nsecret.env\n")
    build_package(ignored, inputs["report"], tmp_path / "vendor.zip")
    assert "source/lib.py" in _names((tmp_path / "vendor.zip").read_bytes())
    # A folder it does not ignore whose every file is ignored packs none of them (a
    # trial's conf/ held only secret.env and a .pyc: the walk packed both).
    conf = _tree(project / "conf", {"secret.env": b"TOKEN=x\n", "cache.pyc": b"\x00"})
    build_package(conf, inputs["report"], tmp_path / "conf.zip")
    assert not [n for n in _names((tmp_path / "conf.zip").read_bytes())
                if n.startswith("source/")]


def test_symlink_outside_tree_is_refused(inputs: dict[str, Path], tmp_path: Path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_bytes(b"secret")
    (inputs["source"] / "leak.txt").symlink_to(secret)
    with pytest.raises(PackageError) as err:
        build_package(inputs["source"], inputs["report"], tmp_path / "p.zip")
    assert err.value.code == "PKG_SYMLINK"
    assert not (tmp_path / "p.zip").exists()


def test_symlink_inside_tree_packs_target_bytes(inputs: dict[str, Path], tmp_path: Path) -> None:
    (inputs["source"] / "alias.py").symlink_to(inputs["source"] / "app/util.py")
    build_package(inputs["source"], inputs["report"], tmp_path / "p.zip")
    snap = PackageReader().read((tmp_path / "p.zip").read_bytes())
    assert snap.read_source("alias.py") == b"X = 2\n"


def test_directory_symlink_is_refused(inputs: dict[str, Path], tmp_path: Path) -> None:
    (inputs["source"] / "loop").symlink_to(inputs["source"])
    with pytest.raises(PackageError) as err:
        build_package(inputs["source"], inputs["report"], tmp_path / "p.zip")
    assert err.value.code == "PKG_SYMLINK"


def test_db_must_be_sqlite(inputs: dict[str, Path], tmp_path: Path) -> None:
    fake = tmp_path / "fake.sqlite"
    fake.write_bytes(b"not a database")
    with pytest.raises(PackageError) as err:
        build_package(inputs["source"], inputs["report"], tmp_path / "p.zip", db=fake)
    assert err.value.code == "PKG_DB_NOT_SQLITE"


def test_bad_inputs(inputs: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(PackageError) as err:
        build_package(tmp_path / "missing", inputs["report"], tmp_path / "p.zip")
    assert err.value.code == "PKG_BUILD_INPUT"
    bad_report = tmp_path / "r.bin"
    bad_report.write_bytes(b"\xff\xfe")
    with pytest.raises(PackageError) as err:
        build_package(inputs["source"], bad_report, tmp_path / "p.zip")
    assert err.value.code == "PKG_REPORT_INVALID"
    (inputs["source"] / "back\\slash.py").write_bytes(b"")
    with pytest.raises(PackageError) as err:
        build_package(inputs["source"], inputs["report"], tmp_path / "p.zip")
    assert err.value.code == "PKG_BAD_NAME"


def test_case_collision_is_refused(inputs: dict[str, Path], tmp_path: Path) -> None:
    (inputs["source"] / "readme.md").write_bytes(b"lower")
    with pytest.raises(PackageError) as err:
        build_package(inputs["source"], inputs["report"], tmp_path / "p.zip")
    assert err.value.code == "PKG_DUPLICATE_ENTRY"


def test_limits_are_applied_while_building(inputs: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(PackageError) as err:
        build_package(inputs["source"], inputs["report"], tmp_path / "p.zip",
                      limits=PackageLimits(max_entries=3))
    assert err.value.code == "PKG_TOO_MANY_ENTRIES"
    with pytest.raises(PackageError) as err:
        build_package(inputs["source"], inputs["report"], tmp_path / "p.zip",
                      limits=PackageLimits(max_entry_bytes=10))
    assert err.value.code == "PKG_ENTRY_TOO_LARGE"


def test_highly_compressible_file_is_stored(inputs: dict[str, Path], tmp_path: Path) -> None:
    (inputs["source"] / "zeros.bin").write_bytes(bytes(1 << 20))
    build_package(inputs["source"], inputs["report"], tmp_path / "p.zip")
    data = (tmp_path / "p.zip").read_bytes()
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        assert archive.getinfo("source/zeros.bin").compress_type == zipfile.ZIP_STORED
        assert archive.getinfo("source/app/main.py").compress_type == zipfile.ZIP_DEFLATED
    assert PackageReader().read(data).read_source("zeros.bin") == bytes(1 << 20)


def _git_commit_all(source: Path, tmp_path: Path) -> list[str]:
    env = {**os.environ, "GIT_CONFIG_NOSYSTEM": "1", "HOME": str(tmp_path)}
    git = ["git", "-C", str(source), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True, env=env)
    subprocess.run([*git, "add", "-A"], check=True, env=env)
    subprocess.run([*git, "commit", "-q", "-m", "init"], check=True, env=env)
    return git


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
@pytest.mark.parametrize("inside", [False, True])
def test_git_mode_refuses_a_linked_parent_directory(inputs: dict[str, Path], tmp_path: Path,
                                                    inside: bool) -> None:
    """Issue 10.1: ``sub/passwd`` is committed, then ``sub`` becomes a link (to a directory
    outside the tree, or inside it) and is ignored: ``git ls-files --cached`` still lists
    ``sub/passwd``, and every component of the path must stay inside the tree."""
    source = inputs["source"]
    outside = _tree(tmp_path / "etc", {"passwd": b"root:x:0:0:root:/root:/bin/bash\n"})
    _tree(source, {"sub/passwd": b"committed\n"})
    _git_commit_all(source, tmp_path)
    shutil.rmtree(source / "sub")
    (source / "sub").symlink_to(source / "app" if inside else outside,
                                target_is_directory=True)
    if inside:
        (source / "app" / "passwd").write_bytes(b"inside\n")
    (source / ".gitignore").write_text("/sub\n")
    with pytest.raises(PackageError) as err:
        build_package(source, inputs["report"], tmp_path / "p.zip")
    assert err.value.code == "PKG_SYMLINK"
    assert "'sub'" in err.value.message and "sub/passwd" in err.value.message
    assert not (tmp_path / "p.zip").exists()


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
def test_git_mode_refuses_a_linked_parent_of_a_linked_file(inputs: dict[str, Path],
                                                           tmp_path: Path) -> None:
    """A file link whose own parent is a link: its target would resolve through it."""
    source = inputs["source"]
    outside = _tree(tmp_path / "etc", {"passwd": b"root\n", "alias": b"x"})
    _tree(source, {"sub/alias": b"committed\n"})
    _git_commit_all(source, tmp_path)
    shutil.rmtree(source / "sub")
    (source / "sub").symlink_to(outside, target_is_directory=True)
    with pytest.raises(PackageError) as err:
        build_package(source, inputs["report"], tmp_path / "p.zip")
    assert err.value.code == "PKG_SYMLINK"


def test_directory_mode_refuses_a_linked_directory_outside(inputs: dict[str, Path],
                                                           tmp_path: Path) -> None:
    outside = _tree(tmp_path / "etc", {"passwd": b"root\n"})
    (inputs["source"] / "sub").symlink_to(outside, target_is_directory=True)
    (inputs["logs"] / "more").symlink_to(outside, target_is_directory=True)
    for logs in (None, inputs["logs"]):
        source = inputs["source"] if logs is None else tmp_path / "clean"
        source.mkdir(exist_ok=True)
        with pytest.raises(PackageError) as err:
            build_package(source, inputs["report"], tmp_path / "p.zip", logs=logs)
        assert err.value.code == "PKG_SYMLINK"
    assert not (tmp_path / "p.zip").exists()


def test_builder_applies_the_name_limits(inputs: dict[str, Path], tmp_path: Path) -> None:
    deep = "/".join(["d"] * 70) + "/f.py"
    _tree(inputs["source"], {deep: b"x"})
    with pytest.raises(PackageError) as err:
        build_package(inputs["source"], inputs["report"], tmp_path / "p.zip")
    assert err.value.code == "PKG_PATH_TOO_DEEP"
    shutil.rmtree(inputs["source"] / "d")
    _tree(inputs["source"], {"evil\u202etxt.py": b"x"})
    with pytest.raises(PackageError) as err:
        build_package(inputs["source"], inputs["report"], tmp_path / "p.zip")
    assert err.value.code == "PKG_BAD_NAME" and "\u202e" not in err.value.message
    assert not (tmp_path / "p.zip").exists()


def _wal_database(path: Path) -> None:
    """A WAL-mode database whose last transactions are only in its -wal file, as a
    running application leaves it (a process that never checkpoints, then exits)."""
    script = (
        "import os, sqlite3, sys\n"
        "c = sqlite3.connect(sys.argv[1])\n"
        "c.execute('PRAGMA journal_mode=WAL'); c.execute('PRAGMA wal_autocheckpoint=0')\n"
        "c.execute('CREATE TABLE orders (id INTEGER PRIMARY KEY, total INTEGER)')\n"
        "c.commit(); c.execute('INSERT INTO orders VALUES (1, 42)'); c.commit()\n"
        "os._exit(0)\n")
    subprocess.run([sys.executable, "-c", script, str(path)], check=True)


def test_a_database_with_a_write_ahead_log_is_packed_with_its_committed_rows(
        inputs: dict[str, Path], tmp_path: Path) -> None:
    """The main file of a WAL-mode database lacks what is still in its -wal file: it was
    packed alone, so the snapshot had no `orders` table at all (a hostile-input trial).
    The packed database is the one SQLite reads, standalone, and the user's files are
    not touched; the build stays deterministic."""
    db = tmp_path / "live.db"
    _wal_database(db)
    wal = Path(f"{db}-wal")
    assert wal.stat().st_size > 0
    with sqlite3.connect(":memory:") as alone:
        main = db.read_bytes()
        alone.deserialize(main[:18] + b"\x01\x01" + main[20:])  # as the tools open it
        assert alone.execute("SELECT name FROM sqlite_master").fetchall() == []
    before = {p.name: p.read_bytes() for p in tmp_path.glob("live.db*")}
    build_package(inputs["source"], inputs["report"], tmp_path / "a.zip", db=db)
    data = (tmp_path / "a.zip").read_bytes()
    packed = PackageReader().read(data).db_bytes("live.sqlite")
    assert packed[18:20] == b"\x01\x01"  # rollback mode: no -wal needed to read it
    conn = sqlite3.connect(":memory:")
    conn.deserialize(packed)
    assert conn.execute("SELECT id, total FROM orders").fetchall() == [(1, 42)]
    conn.close()
    assert {p.name: p.read_bytes() for p in tmp_path.glob("live.db*")} == before
    build_package(inputs["source"], inputs["report"], tmp_path / "b.zip", db=db)
    assert (tmp_path / "b.zip").read_bytes() == data


def test_an_output_that_is_an_input_is_refused_and_the_input_kept(
        inputs: dict[str, Path], tmp_path: Path) -> None:
    """A hostile trial's `-o` named the report: the ZIP replaced its only copy."""
    report = inputs["report"]
    before = report.read_bytes()
    log = tmp_path / "app.log"
    log.write_text("a line\n")
    for output, given in ((report, "the report"), (log, "the logs")):
        with pytest.raises(PackageError) as err:
            build_package(inputs["source"], report, output, logs=log)
        assert err.value.code == "PKG_BUILD_INPUT"
        assert f"the output {output} is {given} given" in err.value.message
    assert report.read_bytes() == before and log.read_text() == "a line\n"
    # The same file by another spelling is the same file.
    spelled = tmp_path / "x" / ".." / report.relative_to(tmp_path)
    (tmp_path / "x").mkdir()
    with pytest.raises(PackageError):
        build_package(inputs["source"], report, spelled)
    assert report.read_bytes() == before


def test_an_empty_source_or_logs_option_is_a_usage_error(
        inputs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`case build --source ""` packed the working directory (a hostile trial)."""
    from typer.testing import CliRunner

    from workers.cli import app

    monkeypatch.chdir(tmp_path)
    for option in ("--source", "--logs"):
        args = {"--source": str(inputs["source"]), "--report": str(inputs["report"]),
                "-o": str(tmp_path / "p.zip"), option: ""}
        res = CliRunner().invoke(app, ["case", "build", *[x for kv in args.items()
                                                          for x in kv]])
        assert res.exit_code == 2 and "is empty" in res.output, (option, res.output)
        assert option in res.output
        assert not (tmp_path / "p.zip").exists()


def test_an_empty_source_tree_is_packed_with_a_warning(
        inputs: dict[str, Path], tmp_path: Path) -> None:
    """An empty source folder packed silently (a trial): every source query of such a case
    finds nothing, so `case build` says so (a database-only case is still built)."""
    import json as _json

    from typer.testing import CliRunner

    from workers.cli import app

    empty = tmp_path / "empty"
    empty.mkdir()
    info = build_package(empty, inputs["report"], tmp_path / "e.zip")
    assert info.source_files == 0
    assert build_package(inputs["source"], inputs["report"],
                         tmp_path / "s.zip").source_files > 0
    args = ["case", "build", "--source", str(empty), "--report", str(inputs["report"]),
            "-o", str(tmp_path / "e2.zip")]
    res = CliRunner().invoke(app, args)
    flat = " ".join(res.output.split())
    assert res.exit_code == 0 and f"warning: the source tree {empty} gave no file to pack" \
        in flat, res.output
    shown = CliRunner().invoke(app, [*args, "--json"])
    assert _json.loads(shown.stdout)["source_files"] == 0
    full = CliRunner().invoke(app, ["case", "build", "--source", str(inputs["source"]),
                                    "--report", str(inputs["report"]), "-o",
                                    str(tmp_path / "s2.zip")])
    assert full.exit_code == 0 and "warning" not in full.output, full.output
