"""How fast a long case's HTML report is written and opened in a real browser.

Builds (once; kept under ``var/bench/report/``) a long case on the scripted provider
(``tests/longcase.py``: 4 hypotheses x 100 queries, about 415 steps with rejections and
questions), runs it to completion on the in-process runtime, then:

* writes its report (``investigate report``'s function), median of 3;
* opens it in Debian's headless Chromium through Playwright, median of 5 fresh pages:
  DOMContentLoaded, the load event and the first contentful paint, in milliseconds.

The target is "opens in under a second": the load-event ratio to 1000 ms is printed.
Run: ``.venv/bin/python bench/report_render.py [--research N] [--fresh]``.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from investigation.constants import COMPLETED  # noqa: E402
from investigation.report import write_report  # noqa: E402
from investigation.store.models import CaseRecord  # noqa: E402
from tests.longcase import long_config, make_long_case  # noqa: E402

CHROMIUM = "/usr/bin/chromium"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def build(work: Path, hypotheses: int, research: int, fresh: bool) -> tuple[object, str]:
    from investigation.store import Store

    marker = work / "case_id"
    if not fresh and marker.exists():
        store = Store(f"sqlite:///{work / 'case' / 'store.db'}")
        case_id = marker.read_text().strip()
        with store.session() as s:
            case = s.get(CaseRecord, case_id)
        if case is not None and case.state == "BUILDING_DIAGNOSIS":
            return store, case_id
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    case = make_long_case(work / "case", hypotheses, research)
    started = time.monotonic()
    outcome = case.investigator(long_config(research)).run(case.case_id, max_steps=100_000)
    print(f"ran the long case: {outcome.step_seq} steps in "
          f"{time.monotonic() - started:.0f} s ({outcome.outcome})")
    if outcome.outcome != COMPLETED:
        raise SystemExit(f"the long case did not complete: {outcome}")
    marker.write_text(case.case_id)
    return case.store, case.case_id


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hypotheses", type=int, default=4)
    parser.add_argument("--research", type=int, default=100)
    parser.add_argument("--fresh", action="store_true", help="rebuild the case")
    parser.add_argument("--pages", type=int, default=5)
    args = parser.parse_args()
    work = REPO / "var" / "bench" / "report"
    store, case_id = build(work, args.hypotheses, args.research, args.fresh)
    target = work / "report.html"
    times = []
    for _ in range(3):
        started = time.perf_counter()
        size = write_report(store, case_id, target)  # type: ignore[arg-type]
        times.append((time.perf_counter() - started) * 1000)
    with store.session() as s:  # type: ignore[attr-defined]
        steps = s.get(CaseRecord, case_id).head_seq
    print(f"case {case_id}: {steps} steps; report {size} bytes")
    print(f"write the report (median of 3): {statistics.median(times):.0f} ms")
    if not Path(CHROMIUM).is_file():
        raise SystemExit(f"{CHROMIUM} is missing: apt-get install chromium")
    from playwright.sync_api import sync_playwright

    rows = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=FLAGS)
        try:
            for _ in range(args.pages):
                page = browser.new_page(viewport={"width": 1300, "height": 900})
                page.goto(target.as_uri())
                nav = page.evaluate("performance.getEntriesByType('navigation')[0].toJSON()")
                fcp = page.evaluate("(performance.getEntriesByName('first-contentful-paint')"
                                    "[0] || {}).startTime")
                rows.append((nav["domContentLoadedEventEnd"], nav["loadEventEnd"], fcp or 0.0))
                page.close()
        finally:
            browser.close()
    dcl, load, fcp = (statistics.median(r[i] for r in rows) for i in range(3))
    print(f"Chromium, median of {len(rows)} fresh pages: first contentful paint {fcp:.0f} ms, "
          f"DOMContentLoaded {dcl:.0f} ms, load {load:.0f} ms")
    print(f"ratio load / 1000 ms target: {load / 1000:.2f}")


if __name__ == "__main__":
    main()
