#!/usr/bin/env python
"""``source.search`` over a packed Python standard library against ripgrep on the tree.

What it does, on this machine:

1. copies the standard library of the running interpreter (``sysconfig`` ``stdlib``)
   without ``site-packages``, ``__pycache__``, the ``config-*`` directory (its static
   ``libpython`` exceeds the package's 32 MiB entry limit) and ``lib-dynload`` (compiled
   extension modules), and packs it with ``investigate case build``;
2. opens the package with a ``PackageReader`` whose text index lives in the benchmark's
   temporary directory, and times the first ``source.search`` (which builds the package's
   shared text index, once per package and host) and the opening of that index by a
   second reader (what another worker process pays: the full check of the file);
3. times, interleaved over ``--rounds`` rounds, ``ToolRouter.execute("source.search")``
   with the default tool limits (5 s search deadline) and ``rg`` on the extracted tree,
   for a literal and a regular expression, and prints the medians and their ratio;
4. does the same on a tree four times larger (four copies under ``a/`` ``b/`` ``c/`` ``d/``)
   and checks that the result is complete: no ``PARTIAL``/``TRUNCATED`` warning and four
   times the items of one copy;
5. for reference, times the engine's previous per-line search (``tests/search_reference.py``)
   once per query (``--no-reference`` skips it).

ripgrep runs as ``rg --no-config --no-ignore --hidden -n`` (``-F`` for the literal) with
its output read through a pipe (it is not told to stop early). The same regex text means
the same lines here, except that ripgrep's ``\\w``/``\\s`` are Unicode classes and RE2's
ASCII ones (the standard library gives both the same counts, printed side by side). The
machine is shared: the load (``uptime``) is printed before and after, and every ratio is
measured within one run.
Prints figures and targets; asserts nothing. Usage (from the repository root)::

    .venv/bin/python bench/search.py [--rounds 7] [--stdlib DIR] [--keep DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from investigation.cases.reader import PackageReader  # noqa: E402
from investigation.config import ToolLimits  # noqa: E402
from investigation.tools import ToolRouter  # noqa: E402

LITERAL_TARGET = 3.0
REGEX_TARGET = 5.0
#: (kind, pattern, target ratio). Few enough matches that four copies stay under the
#: 200-item cap, so every search reads the whole tree.
QUERIES = (
    ("literal", "zipimporter", LITERAL_TARGET),
    ("regex", r"^\s+def test_\w*surrogate\w*\(", REGEX_TARGET),
    ("regex", r"except \(\w+Error, \w+Error\) as \w+:", REGEX_TARGET),
    ("regex", r'encoding="latin-?1"', REGEX_TARGET),
)
NO_RG = ("!" * 78 + "\n! rg (ripgrep) is NOT installed: the ratios against ripgrep are NOT "
         "measured.\n! Install it (Debian: apt-get install ripgrep) and run again.\n"
         + "!" * 78)
EXCLUDED = {"site-packages", "__pycache__", "lib-dynload"}
PREFIXES = ("a", "b", "c", "d")


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, check=True,
                              timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        load = os.getloadavg()
        return f"load average: {load[0]:.2f}, {load[1]:.2f}, {load[2]:.2f}"


def copy_stdlib(stdlib: Path, dest: Path) -> None:
    def ignore(directory: str, names: list[str]) -> list[str]:
        return [n for n in names if n in EXCLUDED or n.startswith("config-")]
    shutil.copytree(stdlib, dest, ignore=ignore)


def tree_size(root: Path) -> tuple[int, int]:
    files = [p for p in root.rglob("*") if p.is_file()]
    return len(files), sum(p.stat().st_size for p in files)


def build_package(source: Path, report: Path, output: Path) -> float:
    cli = Path(sys.executable).parent / "investigate"
    command = [str(cli)] if cli.exists() else [sys.executable, "-m", "workers.cli"]
    started = time.perf_counter()
    # The standard library's tests hold sample keys and certificates, which the build
    # refuses by default (PKG_SECRETS_FOUND); tool results still mask them.
    subprocess.run([*command, "case", "build", "--source", str(source), "--report",
                    str(report), "-o", str(output), "--allow-secrets"], check=True,
                   capture_output=True, text=True, cwd=REPO)
    return time.perf_counter() - started


def rg_command(pattern: str, regex: bool, tree: Path) -> list[str]:
    rg = shutil.which("rg")
    assert rg is not None
    return [rg, "--no-config", "--no-ignore", "--hidden", "-n", "--color", "never",
            *([] if regex else ["-F"]), "-e", pattern, str(tree)]


def time_rg(command: list[str]) -> tuple[float, int]:
    started = time.perf_counter()
    done = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                          check=False)
    elapsed = time.perf_counter() - started
    if done.returncode not in (0, 1):
        raise RuntimeError(f"rg failed with exit code {done.returncode}")
    return elapsed, done.stdout.count(b"\n")


def time_search(router: ToolRouter, arguments: dict[str, Any]) -> tuple[float, Any]:
    started = time.perf_counter()
    result = router.execute("source.search", arguments)
    return time.perf_counter() - started, result


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms"


class Report:
    """Rows of figure | measured | target | verdict, printed at the end."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, str, str, str]] = []

    def add(self, figure: str, measured: str, target: str = "", verdict: str = "") -> None:
        self.rows.append((figure, measured, target, verdict))
        print(f"  {figure}: {measured}" + (f"  (target {target}: {verdict})" if target else ""),
              flush=True)

    def print(self) -> None:
        widths = [max(len(r[i]) for r in [*self.rows, ("figure", "measured", "target",
                                                       "verdict")]) for i in range(4)]
        line = " | ".join
        print("\n" + line(h.ljust(w) for h, w in zip(("figure", "measured", "target",
                                                      "verdict"), widths, strict=True)))
        print("-+-".join("-" * w for w in widths))
        for row in self.rows:
            print(line(c.ljust(w) for c, w in zip(row, widths, strict=True)))


def compare(report: Report, label: str, tree: Path, router: ToolRouter, rounds: int,
            have_rg: bool, check: Callable[[str, Any], None] | None = None
            ) -> dict[str, int]:
    """Each query, engine vs rg, interleaved rounds; returns items per pattern."""
    counts: dict[str, int] = {}
    for kind, pattern, target in QUERIES:
        arguments = {"pattern": pattern, "regex": kind == "regex"}
        engine: list[float] = []
        rg: list[float] = []
        rg_lines = 0
        result: Any = None
        for _ in range(rounds):
            if have_rg:
                elapsed, rg_lines = time_rg(rg_command(pattern, kind == "regex", tree))
                rg.append(elapsed)
            elapsed, result = time_search(router, arguments)
            engine.append(elapsed)
        counts[pattern] = len(result.items)
        warnings = ",".join(result.warnings) or "none"
        report.add(f"{label} {kind} `{pattern}`: source.search median",
                   f"{ms(statistics.median(engine))} ({len(result.items)} items, "
                   f"warnings {warnings})")
        if check is not None:
            check(pattern, result)
        if have_rg:
            ratio = statistics.median(engine) / statistics.median(rg)
            report.add(f"{label} {kind} `{pattern}`: rg median",
                       f"{ms(statistics.median(rg))} ({rg_lines} lines)")
            report.add(f"{label} {kind} `{pattern}`: ratio source.search / rg",
                       f"{ratio:.2f}x", f"<= {target:g}x",
                       "met" if ratio <= target else "NOT met")
        else:
            report.add(f"{label} {kind} `{pattern}`: ratio source.search / rg",
                       "not measured (no rg)", f"<= {target:g}x", "NOT measured")
    return counts


def reference_once(report: Report, label: str, snapshot: Any) -> None:
    from tests.search_reference import ReferenceRouter

    router = ReferenceRouter(snapshot, ToolLimits())
    for kind, pattern, _target in QUERIES:
        started = time.perf_counter()
        result = router.execute("source.search", {"pattern": pattern,
                                                  "regex": kind == "regex"})
        elapsed = time.perf_counter() - started
        report.add(f"{label} {kind} `{pattern}`: before (per-line search, one run)",
                   f"{ms(elapsed)} ({len(result.items)} items, warnings "
                   f"{','.join(result.warnings) or 'none'})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--stdlib", type=Path, default=Path(sysconfig.get_paths()["stdlib"]))
    parser.add_argument("--keep", type=Path, default=None,
                        help="work in this directory and keep it (default: a temporary one)")
    parser.add_argument("--no-reference", action="store_true",
                        help="skip timing the previous per-line search")
    args = parser.parse_args(argv)

    print("bench/search.py: source.search over a packed standard library vs ripgrep")
    print(f"load before: {uptime()}")
    have_rg = shutil.which("rg") is not None
    if have_rg:
        version = subprocess.run(["rg", "--version"], capture_output=True, text=True,
                                 check=False).stdout.splitlines()[0]
        print(f"ripgrep: {version}")
    else:
        print(NO_RG)

    work = args.keep or Path(tempfile.mkdtemp(prefix="bench-search-"))
    work.mkdir(parents=True, exist_ok=True)
    report = Report()
    try:
        tree = work / "stdlib"
        if not tree.exists():
            copy_stdlib(args.stdlib, tree)
        files, size = tree_size(tree)
        print(f"tree: {args.stdlib} -> {files} files, {size / 2**20:.1f} MiB")
        (work / "report.md").write_text("Search benchmark.\n")
        package = work / "stdlib.zip"
        if not package.exists():
            print(f"  package built in {build_package(tree, work / 'report.md', package):.1f} s")
        index_dir = work / "text-index"
        shutil.rmtree(index_dir, ignore_errors=True)
        data = package.read_bytes()
        snapshot = PackageReader(text_index_dir=index_dir).read(data)
        router = ToolRouter(snapshot, ToolLimits())
        elapsed, first = time_search(router, {"pattern": QUERIES[0][1]})
        report.add("1x first search (builds the text index)", ms(elapsed))
        index = snapshot.text_index()
        print(f"  text index: {index.size_bytes / 2**20:.1f} MiB" if index else
              "  text index: NONE (searches read the package)",
              f"({first.stats['files_scanned']} text files; "
              f"{first.stats['files_skipped']} binary or not UTF-8)")
        other = PackageReader(text_index_dir=index_dir).read(data)
        started = time.perf_counter()
        assert other.text_index() is not None
        report.add("1x another process opens and checks the index",
                   ms(time.perf_counter() - started))
        single = compare(report, "1x", tree, router, args.rounds, have_rg)
        if not args.no_reference:
            reference_once(report, "1x", snapshot)

        tree4 = work / "stdlib-x4"
        if not tree4.exists():
            tree4.mkdir()
            for prefix in PREFIXES:
                shutil.copytree(tree, tree4 / prefix, copy_function=os.link)
        files4, size4 = tree_size(tree4)
        print(f"tree x4: {files4} files, {size4 / 2**20:.1f} MiB")
        package4 = work / "stdlib-x4.zip"
        if not package4.exists():
            print(f"  package built in {build_package(tree4, work / 'report.md', package4):.1f} s")
        snapshot4 = PackageReader(text_index_dir=index_dir).read(package4.read_bytes())
        router4 = ToolRouter(snapshot4, ToolLimits())
        elapsed, _ = time_search(router4, {"pattern": QUERIES[1][1], "regex": True})
        report.add("4x first search (builds the text index; not counted in the deadline)",
                   ms(elapsed))

        def complete(pattern: str, result: Any) -> None:
            ok = (len(result.items) == 4 * single[pattern]
                  and not {"PARTIAL", "TRUNCATED"} & set(result.warnings))
            report.add(f"4x `{pattern}`: complete result (4 x {single[pattern]} items, "
                       "no PARTIAL or TRUNCATED)", f"{len(result.items)} items",
                       "complete within the 5 s default deadline", "met" if ok else "NOT met")

        compare(report, "4x", tree4, router4, args.rounds, have_rg, complete)
        if not args.no_reference:
            reference_once(report, "4x", snapshot4)
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)
    report.print()
    if not have_rg:
        print(NO_RG)
    print(f"\nload after: {uptime()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
