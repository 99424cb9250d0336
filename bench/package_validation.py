"""Package validation cost: time and peak memory for the worst names the limits allow.

Issue 10.2: a 42 MB package of 19,990 empty entries named ``source/<i>/a/a/.../f``
(about 1,000 bytes each) took 6.3 GB and minutes to validate, because the collision check
kept every prefix of every name. Validation must be linear in the package's size with a
bounded memory figure.

What this prints, each line one package validated once by a fresh ``PackageReader``
(no cache hit) in this process:

* ``worst names``: as many entries as ``PackageLimits()`` allows (``max_entries`` less the
  manifest and report), every name ``max_name_bytes`` long and ``max_path_depth`` deep:
  the worst package for the name checks within the default limits;
* ``scaling``: the same names at a quarter, half and all of the entries, with the time
  and peak per entry, whose ratios show linear growth;
* ``issue shape``: the issue's own 19,990 ``a/a/.../f`` names (498 segments each), with
  the depth limit raised so that the names reach the collision check.

Time is one validation without tracing; peak memory is ``tracemalloc``'s peak of Python
allocations during a second one (the archive's own bytes are allocated before and not
counted), printed beside the archive's size. Run: ``.venv/bin/python bench/package_validation.py`` (about a minute).
"""

from __future__ import annotations

import time
import tracemalloc

from investigation.cases.builder import package_bytes
from investigation.cases.reader import PackageReader
from investigation.config import PackageLimits


def worst_names(count: int, name_bytes: int, depth: int) -> dict[str, bytes]:
    """``count`` empty source files, each name exactly ``name_bytes`` long with ``depth``
    segments (``source/<i>/xxxx/.../xxxx``), plus the report."""
    files = {"report.md": b"report\n"}
    for i in range(count):
        head = f"source/{i}"
        inner = depth - 2
        room = name_bytes - len(head) - inner  # bytes left for the inner segments' letters
        width, extra = divmod(room, inner)
        segments = ["x" * (width + (1 if k < extra else 0)) for k in range(inner)]
        files["/".join([head, *segments])] = b""
    return files


def issue_names(count: int) -> dict[str, bytes]:
    """The issue's names: ``source/<i>/a/a/.../f`` of about 1,000 bytes."""
    files = {"report.md": b"report\n"}
    for i in range(count):
        head = f"source/{i}/"
        files[head + "a/" * ((1000 - len(head) - 1) // 2) + "f"] = b""
    return files


def measure(files: dict[str, bytes], limits: PackageLimits) -> tuple[int, float, int]:
    """``(archive bytes, seconds, peak bytes)``: the time of one validation, then the peak
    of another one under ``tracemalloc`` (which slows allocations, so it is not timed)."""
    data, _ = package_bytes(files, [], False, limits)
    started = time.perf_counter()
    PackageReader(limits, entry_cache_bytes=0).validate(data)
    elapsed = time.perf_counter() - started
    reader = PackageReader(limits, entry_cache_bytes=0)
    tracemalloc.start()
    try:
        reader.validate(data)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return len(data), elapsed, peak


def _mib(n: float) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def main() -> None:
    limits = PackageLimits()
    most = limits.max_entries - 2  # the manifest and the report are entries too
    print(f"limits: max_entries={limits.max_entries} max_name_bytes={limits.max_name_bytes} "
          f"max_path_depth={limits.max_path_depth} "
          f"max_segment_bytes={limits.max_segment_bytes}")
    size, seconds, peak = measure(
        worst_names(most, limits.max_name_bytes, limits.max_path_depth), limits)
    print(f"worst names: {most} entries, archive {_mib(size)}: validate {seconds:.2f} s, "
          f"peak {_mib(peak)} ({peak / size:.2f}x the archive)")
    print("scaling (same names):")
    for count in (most // 4, most // 2, most):
        size, seconds, peak = measure(
            worst_names(count, limits.max_name_bytes, limits.max_path_depth), limits)
        print(f"  {count:>6} entries: {seconds:6.2f} s ({seconds / count * 1e6:6.1f} us per "
              f"entry), peak {_mib(peak):>10} ({peak / count / 1024:5.2f} KiB per entry)")
    deep = PackageLimits(max_path_depth=1000)
    size, seconds, peak = measure(issue_names(19_990), deep)
    print(f"issue shape: 19990 names of 498 segments, archive {_mib(size)}, "
          f"max_path_depth=1000: validate {seconds:.2f} s, peak {_mib(peak)} "
          f"({peak / size:.2f}x the archive); with the default depth limit it is refused "
          "(PKG_PATH_TOO_DEEP) at its first name")


if __name__ == "__main__":
    main()
