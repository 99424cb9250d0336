"""The HTML case report (``investigate report``): what it contains, that everything the
snapshot or the model supplied is inert, and what a real browser draws.

The browser test runs Debian's Chromium headless through Playwright (never a downloaded
browser); locally it skips without them, under CI it fails (``tests.conftest.need_browser``).
"""

from __future__ import annotations

import json
import re
import statistics
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest
from sqlmodel import col, select
from typer.testing import CliRunner

from investigation.constants import BLOCKED, COMPLETED
from investigation.operations import summary_bytes
from investigation.report import case_history, render_report, write_report
from investigation.report.history import units_text
from investigation.store.models import Checkpoint, Evidence, LedgerEntry
from tests.casekit import Case, finish, make_case, q
from tests.conftest import need_browser
from tests.longcase import HOSTILE_LINE, long_config, make_long_case

RESEARCH = 8
HYPOTHESES = 3


@pytest.fixture(scope="module")
def long_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Case, Path]:
    """A real run of a multi-hypothesis case with rejections, questions and a hostile
    snapshot line, and its report."""
    root = tmp_path_factory.mktemp("report")
    case = make_long_case(root / "case", HYPOTHESES, RESEARCH, reject_every=10)
    outcome = case.investigator(long_config(RESEARCH)).run(case.case_id, max_steps=10_000)
    assert outcome.outcome == COMPLETED, outcome
    target = root / "report.html"
    write_report(case.store, case.case_id, target)
    return case, target


class _Tags(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.text: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))

    def handle_data(self, data: str) -> None:
        self.text.append(data)


def _parse(html: str) -> _Tags:
    parser = _Tags()
    parser.feed(html)
    return parser


def _classes(tag: tuple[str, dict[str, str | None]]) -> set[str]:
    return set((tag[1].get("class") or "").split())


def test_report_holds_every_step_chart_and_evidence(long_run: tuple[Case, Path]) -> None:
    case, target = long_run
    html = target.read_text(encoding="utf-8")
    parsed = _parse(html)
    with case.store.session() as s:
        steps = len(s.exec(select(Checkpoint).where(Checkpoint.case_id == case.case_id)).all())
        evidence = [e.evidence_id for e in s.exec(select(Evidence).where(
            Evidence.case_id == case.case_id).order_by(col(Evidence.ordinal)))]
        charges = len(s.exec(select(LedgerEntry).where(
            LedgerEntry.case_id == case.case_id, LedgerEntry.kind == "reserve")).all())
        refunds = len(s.exec(select(LedgerEntry).where(
            LedgerEntry.case_id == case.case_id, LedgerEntry.kind == "refund",
            LedgerEntry.amount_units > 0)).all())
    assert steps > HYPOTHESES * RESEARCH and len(evidence) == HYPOTHESES * RESEARCH
    rects = [t for t in parsed.tags if t[0] == "rect" and "step" in _classes(t)]
    assert [int(t[1]["data-seq"] or 0) for t in rects] == list(range(1, steps + 1))
    assert sum(1 for t in parsed.tags if t[0] == "path" and "series" in _classes(t)) == \
        HYPOTHESES
    assert sum(1 for t in parsed.tags if t[0] == "svg" and "chart-budget" in _classes(t)) == \
        HYPOTHESES
    assert sum(1 for t in parsed.tags if t[0] == "line" and "charge" in _classes(t)) == charges
    assert sum(1 for t in parsed.tags if t[0] == "line" and "refund" in _classes(t)) == refunds
    ids = {t[1].get("id") for t in parsed.tags}
    assert {f"ev-{e}" for e in evidence} <= ids
    # Every internal link lands somewhere: timeline cells, evidence and question steps.
    links = [t[1]["href"] for t in parsed.tags if t[0] == "a" and t[1].get("href")]
    assert {f"#step-{n}" for n in range(1, steps + 1)} <= set(links)
    assert all(href[1:] in ids for href in links if href.startswith("#")), \
        sorted(href for href in links if href.startswith("#") and href[1:] not in ids)
    text = "".join(parsed.text)
    assert "UNKNOWN_EVIDENCE_ID" in text  # the rejected replies, with their code
    # The timeline's legend names the outcomes this case had, not every possible one.
    legend = html.split('<div class="legend">', 1)[1].split("</div>", 1)[0]
    assert "PROGRESSED" in legend and "REJECTED" in legend and "COMPLETED" in legend
    assert "RETRY_PENDING" not in legend and "YIELDED" not in legend
    assert "not published" not in legend
    history = case_history(case.store, case.case_id)
    for e in history.evidence:
        assert e["artifact_path"] in text
        for item in e["items"]:
            if "\x1b" not in item["quote"] and "\u202e" not in item["quote"]:
                assert item["quote"] in text  # the exact quote, unescaped by the parser
    for qn in history.questions:
        assert qn["text"] in text
    # The overview counts duplicate and empty results and gives the scores' spread (a
    # real model's run of nine duplicate listings, each scored 0, read as a success).
    dup = sum(1 for e in history.evidence if e["duplicate"])
    empty = sum(1 for e in history.evidence if not e["new_item_count"])
    shown = f"<b>evidence records</b>{len(history.evidence)}: {len(history.evidence) - empty} " \
        f"found new items, {empty} found nothing new"
    assert shown + (f" ({dup} duplicate" if dup else "</div>") in html, html[:3000]
    scores = sorted(e["assessment_score"] for e in history.evidence if e["assessed"])
    middle = statistics.median(scores)
    shown_median = int(middle) if float(middle).is_integer() else middle
    assert scores and f"<b>assessment scores</b>{len(scores)} assessed: lowest {scores[0]}, " \
        f"median {shown_median}, highest {scores[-1]}</div>" in html
    # Statements and the interpretation keep their line breaks (a re-trial's multi-line
    # hypothesis showed as one line).
    assert ".text{white-space:pre-wrap}" in html and '<p class="sub text">' in html
    assert html.count("<td class='wide text'>") == HYPOTHESES
    # A resolved question in a step's note links to its row (checked to land above).
    resolved = {q for st in history.steps for q in st.resolved_questions}
    assert resolved and {f"#q-{q}" for q in resolved} <= set(links)
    # A score names the record it scored, the hypothesis's previous result, and the
    # model's reason (a 500-step reader took "score 89 ... E250" for E250's score and
    # found no reason anywhere).
    scored = [st for st in history.steps if st.score is not None]
    assert scored and all(st.assessed_evidence and st.assessed_evidence != st.evidence_id
                          for st in scored)
    for st in scored:
        row = html.split(f'<tr id="step-{st.seq}">', 1)[1].split("</tr>", 1)[0]
        assert f'{st.score} <a class=muted href="#ev-{st.assessed_evidence}">' in row, row
        if st.score_reason:
            assert f"assessed {st.assessed_evidence}:</span> " in row, row
    assert any(st.score_reason for st in scored)
    # Model time bars say their unit once ("84651 ms ms" in a real model's report).
    times = re.findall(r'class="bar model-time"[^>]*><title>step \d+: ([^<]*)</title>', html)
    assert times and all(re.fullmatch(r"\d+ ms|\d+\.\d\d s", t) for t in times), times[:5]


def test_everything_supplied_is_inert(long_run: tuple[Case, Path]) -> None:
    _, target = long_run
    html = target.read_text(encoding="utf-8")
    parsed = _parse(html)
    assert not [t for t in parsed.tags if t[0] in ("script", "img", "iframe", "object",
                                                   "embed", "link", "base", "form")]
    for tag, attrs in parsed.tags:
        assert not [a for a in attrs if a.startswith("on")], (tag, attrs)
        for name in ("src", "href", "action", "xlink:href"):
            value = attrs.get(name)
            assert value is None or value.startswith("#"), (tag, name, value)
    csp = [a for t, a in parsed.tags if t == "meta" and a.get("http-equiv") ==
           "Content-Security-Policy"]
    assert csp and "default-src 'none'" in (csp[0]["content"] or "")
    for raw in ("\x1b", "\u202e", "\u202c", "\u200b"):
        assert raw not in html
    text = "".join(parsed.text)
    visible = (HOSTILE_LINE.replace("\x1b", "U+001B").replace("\u202e", "U+202E")
               .replace("\u202c", "U+202C").replace("\u200b", "U+200B"))
    assert visible in text  # shown as written, every invisible character marked
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html


def test_a_blocked_case_report_says_what_to_do(tmp_path: Path) -> None:
    bad = q("source.search", {"pattern": "x"}, evidence=["E9"])
    case = make_case(tmp_path / "case", replies=[bad, bad, bad])
    outcome = case.investigator().run(case.case_id)
    assert outcome.outcome == BLOCKED
    html = render_report(case.store, case.case_id)
    text = "".join(_parse(html).text)
    assert "INVALID_LLM_RESPONSES" in text
    assert f"investigate resume {case.case_id}" in text
    assert f"investigate replies check replies.jsonl {case.case_id}" in text
    assert text.count("UNKNOWN_EVIDENCE_ID") >= 3


def test_report_command(long_run: tuple[Case, Path], tmp_path: Path,
                        monkeypatch: pytest.MonkeyPatch) -> None:
    case, _ = long_run
    monkeypatch.setenv("INVESTIGATE_DATABASE_URL", case.store.url)
    monkeypatch.setenv("INVESTIGATE_HOME", str(tmp_path / "home"))
    from workers.cli import app

    target = tmp_path / "out.html"
    res = CliRunner().invoke(app, ["report", case.case_id, "-o", str(target), "--json"])
    assert res.exit_code == 0, res.output
    info = json.loads(res.stdout)
    assert info["bytes"] == target.stat().st_size and info["path"] == str(target.resolve())
    res = CliRunner().invoke(app, ["report", "case-0000000000000000", "-o", str(target)])
    assert res.exit_code == 2 and "CASE_NOT_FOUND" in res.output
    # A folder that does not exist yet is made, as `case build -o` makes one (a new user
    # got IO_ERROR); an unknown case makes none.
    res = CliRunner().invoke(app, ["report", "case-0000000000000000", "-o",
                                   str(tmp_path / "none" / "r.html")])
    assert res.exit_code == 2 and not (tmp_path / "none").exists()
    nested = tmp_path / "out" / "x" / "report.html"
    res = CliRunner().invoke(app, ["report", case.case_id, "-o", str(nested)])
    assert res.exit_code == 0 and nested.stat().st_size > 0, res.output


def test_steps_shows_the_step_table_in_the_terminal(
        long_run: tuple[Case, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A 500-step reader without a browser had no way to read step N but `export` and
    the JSON files: `investigate steps` prints the report's step table, a range or one
    hypothesis of it, as text or JSON."""
    case, _ = long_run
    monkeypatch.setenv("INVESTIGATE_DATABASE_URL", case.store.url)
    monkeypatch.setenv("INVESTIGATE_HOME", str(tmp_path / "home"))
    from workers.cli import app

    history = case_history(case.store, case.case_id)
    cited = next(st for st in history.steps if st.cited_evidence and st.evidence_id
                 and st.score is not None)
    res = CliRunner().invoke(app, ["steps", case.case_id, "--from", str(cited.seq),
                                   "--to", str(cited.seq + 1)])
    assert res.exit_code == 0, res.output
    heads = [line for line in res.output.splitlines() if line.startswith("step ")]
    assert [h.split()[1] for h in heads] == [str(cited.seq), str(cited.seq + 1)]
    assert res.output.splitlines()[-1] == f"2 of {len(history.steps)} step(s) shown"
    assert heads[0].startswith(f"step {cited.seq}  H{cited.hypothesis_id}  {cited.action}")
    block = res.output.split(heads[1])[0]
    assert f"    found: {cited.evidence_id}, {cited.found[0]}" in block
    assert f"; cites {', '.join(cited.cited_evidence)}" in block
    assert f"    assessed {cited.assessed_evidence}: {cited.score}/100" in block
    # The refund is the assessed record's, named so (a 500-step reader took it for the
    # record found at that step); the report's step table says the same.
    refunded = next(st for st in history.steps if st.refunded_units and st.assessed_evidence)
    assert units_text(refunded) == (
        f"-{refunded.charged_units} +{refunded.refunded_units} (refund for "
        f"{refunded.assessed_evidence}) ({refunded.balance_after} left)")
    res = CliRunner().invoke(app, ["steps", case.case_id, "--from", str(refunded.seq),
                                   "--to", str(refunded.seq)])
    assert f"units {units_text(refunded)}" in res.output, res.output
    assert f"<td class=nw>{units_text(refunded)}</td>" in render_report(case.store,
                                                                       case.case_id)
    assert "    selected: " in block and f"    note: {cited.note}" in block
    mine = [st.seq for st in history.steps if st.hypothesis_id == 2]
    res = CliRunner().invoke(app, ["steps", case.case_id, "-H", "2", "--json"])
    assert res.exit_code == 0, res.output
    shown = json.loads(res.stdout)
    assert [row["seq"] for row in shown["steps"]] == mine
    assert all(row["hypothesis_id"] == 2 for row in shown["steps"])
    res = CliRunner().invoke(app, ["steps", case.case_id, "-H", "99"])
    assert res.exit_code == 2 and "HYPOTHESIS_NOT_FOUND" in res.output, res.output
    assert f"its hypotheses: {', '.join(f'H{i}' for i in sorted(history.statements))}" \
        in " ".join(res.output.split())
    last_step = history.steps[-1].seq
    res = CliRunner().invoke(app, ["steps", case.case_id, "--from", str(last_step + 1)])
    assert res.exit_code == 0 and f"no step from step {last_step + 1}" in res.output
    # A finish's reason is a line of its own, below the head line with the outcome.
    closing = next(st for st in history.steps if st.action == "finish")
    res = CliRunner().invoke(app, ["steps", case.case_id, "--from", str(closing.seq),
                                   "--to", str(closing.seq)])
    head, reason = res.output.splitlines()[:2]
    assert head.endswith(closing.outcome or "-") and "reason" not in head, head
    assert reason == f"    reason: {closing.arguments['reason']}", reason
    res = CliRunner().invoke(app, ["steps", case.case_id, "--from", "9", "--to", "3"])
    assert res.exit_code == 2 and "is after --to 3" in res.output, res.output
    res = CliRunner().invoke(app, ["steps", "case-0000000000000000"])
    assert res.exit_code == 2 and "CASE_NOT_FOUND" in res.output


def test_chromium_draws_the_report(long_run: tuple[Case, Path], tmp_path: Path) -> None:
    chromium = need_browser()
    from playwright.sync_api import sync_playwright

    case, target = long_run
    with case.store.session() as s:
        steps = len(s.exec(select(Checkpoint).where(Checkpoint.case_id == case.case_id)).all())
        evidence = [e.evidence_id for e in s.exec(select(Evidence).where(
            Evidence.case_id == case.case_id).order_by(col(Evidence.ordinal)))]
    requests: list[str] = []
    problems: list[str] = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(
            executable_path=chromium, headless=True,
            args=["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                  "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync"])
        try:
            page = browser.new_page(viewport={"width": 1300, "height": 900})
            page.on("request", lambda r: requests.append(r.url))
            page.on("console", lambda m: problems.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: problems.append(str(e)))
            page.goto(target.as_uri())
            drawn: dict[str, Any] = page.evaluate("""() => {
                const box = el => { const r = el.getBoundingClientRect();
                                    return r.width > 0 && r.height > 0; };
                const stroke = el => { const r = el.getBoundingClientRect();
                                       return r.height > 0 && r.x > 0; };
                const all = sel => Array.from(document.querySelectorAll(sel));
                return {
                  steps: all('svg.chart-timeline rect.step').filter(box).length,
                  series: all('svg.chart-confidence path.series').filter(box).length,
                  points: all('svg.chart-confidence circle.point').filter(box).length,
                  budgets: all('svg.chart-budget').filter(box).length,
                  balances: all('svg.chart-budget path.balance').filter(box).length,
                  charges: all('svg.chart-budget line.charge').filter(stroke).length,
                  bars: all('svg.chart-bars rect.bar').length,
                  scripts: all('script').length,
                  evidence: all('details.ev summary b.evid').filter(box)
                              .map(e => e.textContent),
                };
            }""")
            page.screenshot(path=str(tmp_path / "report.png"), full_page=False)
            page.click("#ev-E1 summary")
            opened = page.inner_text("#ev-E1")
            page.locator("#charts").screenshot(path=str(tmp_path / "charts.png"))
            # A link to a record or a step lands clear of the sticky bars, the record's
            # findings shown (a reader's trial: E250 landed closed under the nav,
            # #step-250 showed row 251 first). The target is the record itself, so a
            # browser without ::details-content still lands on its summary.
            last = evidence[-1]
            page.click(f'#timeline a[href="#ev-{last}"]')
            page.wait_for_timeout(300)
            landed: dict[str, Any] = page.evaluate("""(id) => {
                const nav = document.querySelector('nav').getBoundingClientRect().bottom;
                const rec = document.getElementById('ev-' + id);
                const quotes = rec.querySelector('ol.quotes');
                return {shown: quotes.getBoundingClientRect().height > 0, nav: nav,
                        summary: rec.querySelector('summary').getBoundingClientRect().top};
            }""", last)
            page.goto(target.as_uri() + f"#step-{steps // 2}")
            page.wait_for_timeout(300)
            row: dict[str, Any] = page.evaluate("""(seq) => {
                const r = document.getElementById('step-' + seq).getBoundingClientRect();
                // The sticky header cells where they are drawn (the thead's own box
                // stays where the table starts).
                const th = document.querySelector('#timeline thead th')
                                   .getBoundingClientRect();
                const nav = document.querySelector('nav').getBoundingClientRect().bottom;
                return {top: r.top, head: th.bottom, headTop: th.top, nav: nav};
            }""", steps // 2)
            # Unscrolled, in a 1300-pixel window, a row's note (why the step ran, the
            # model's note) is in view: it was the twelfth column, past the right edge.
            note: dict[str, Any] = page.evaluate("""(seq) => {
                const box = document.querySelector('#timeline .scroll')
                                    .getBoundingClientRect();
                const cell = document.querySelector('#step-' + seq + ' td.note')
                                     .getBoundingClientRect();
                return {left: cell.left, right: Math.min(cell.right, box.right),
                        box: box.right};
            }""", steps // 2)
            # Scrolled to the far right, a row still shows its step and
            # hypothesis at the box's left edge (an engineer lost them in a long case).
            sideways: dict[str, Any] = page.evaluate("""(seq) => {
                const box = document.querySelector('#timeline .scroll');
                box.scrollLeft = box.scrollWidth;
                const cells = document.getElementById('step-' + seq).children;
                const left = box.getBoundingClientRect().left;
                const at = cells[0].getBoundingClientRect();
                return {scrolled: box.scrollLeft, wide: box.scrollWidth - box.clientWidth,
                        step: at.left - left,
                        hyp: cells[1].getBoundingClientRect().left - at.right,
                        text: cells[0].textContent,
                        shown: document.elementFromPoint(at.left + 5, at.top + 5)
                               === cells[0]};
            }""", steps // 2)
            # Printed, nothing is cut off: every step row and every record's findings.
            page.emulate_media(media="print")
            printed: dict[str, Any] = page.evaluate("""() => {
                const box = document.querySelector('#timeline .scroll');
                const quotes = Array.from(document.querySelectorAll('details.ev ol.quotes'));
                return {clipped: box.scrollHeight - box.clientHeight,
                        rows: document.querySelectorAll('#timeline tbody tr').length,
                        hidden: quotes.filter(q => q.getBoundingClientRect().height == 0)
                                      .length,
                        quotes: quotes.length};
            }""")
        finally:
            browser.close()
    assert requests == [target.as_uri()]  # nothing but the file itself
    assert problems == []  # no CSP violation, no error
    assert drawn["steps"] == steps
    assert drawn["series"] == HYPOTHESES and drawn["budgets"] == HYPOTHESES
    assert drawn["balances"] == HYPOTHESES and drawn["charges"] == HYPOTHESES * RESEARCH
    assert drawn["points"] > 0 and drawn["bars"] > 0 and drawn["scripts"] == 0
    assert drawn["evidence"] == evidence
    assert "<script>alert(1)</script>" in opened and "U+202E" in opened
    assert landed["shown"] and landed["summary"] >= landed["nav"] - 1, landed
    # The step table's header in view, below the page's nav (a 500-step reader's trial:
    # the box's top, headers and all, landed under the nav).
    assert row["headTop"] >= row["nav"] - 1 and row["top"] >= row["head"] - 1, row
    assert printed["clipped"] <= 1 and printed["rows"] == steps, printed
    assert note["right"] - note["left"] >= 300 and note["box"] <= 1300, note
    assert sideways["wide"] > 0 and sideways["scrolled"] > 0, sideways  # it did scroll
    assert abs(sideways["step"]) <= 2 and abs(sideways["hyp"]) <= 1, sideways
    assert sideways["text"] == str(steps // 2) and sideways["shown"], sideways
    assert printed["quotes"] > 0 and printed["hidden"] == 0, printed
    assert (tmp_path / "report.png").stat().st_size > 10_000


def test_a_step_row_says_what_its_query_found_and_how_confidence_moved(
        long_run: tuple[Case, Path]) -> None:
    """A 500-step reader found a step's item counts, duplicate flag and warnings only in
    its evidence record, and had to work out confidence moves by hand."""
    case, target = long_run
    html = target.read_text(encoding="utf-8")
    history = case_history(case.store, case.case_id)
    by_id = {e["evidence_id"]: e for e in history.evidence}

    def row(seq: int) -> str:
        return html.split(f'<tr id="step-{seq}">', 1)[1].split("</tr>", 1)[0]

    found = [st for st in history.steps if st.evidence_id]
    assert found
    for st in found:
        e = by_id[st.evidence_id or ""]
        words = "item" if e["item_count"] == 1 else "items"
        expected = f"{e['item_count']} {words}, {e['new_item_count']} new"
        assert st.found[0] == expected and f"<span class=muted>{expected}</span>" in row(st.seq)
        assert any(f.startswith("duplicate") for f in st.found) == bool(e["duplicate"])
        if e["duplicate_of"]:  # which record it repeats, there and in the evidence list
            assert f"duplicate of {e['duplicate_of']}" in st.found
            record = html.split(f'id="ev-{e["evidence_id"]}"', 1)[1].split("</details>")[0]
            link = f'<a href="#ev-{e["duplicate_of"]}">{e["duplicate_of"]}</a>'
            assert f", duplicate of {link}" in record and \
                f"The same findings as {link}." in record and "<ol" not in record
    # Where a hypothesis was closed is marked on the timeline chart, and said in its
    # legend (a finish looked like any query's cell); the nav names the step table.
    closing = [st for st in history.steps if st.action in ("finish", "reject")]
    assert closing and html.count('<rect class="close"') == len(closing)
    assert "bar above: closes its hypothesis (finish, reject)" in html
    assert '<a href="#timeline">Steps</a>' in html and "<h3>Outcome of each step</h3>" in html
    # A question's id is shown where it is asked, linked to the questions table.
    asked = [(st, q) for st in history.steps for q in st.new_questions]
    assert asked
    for question in history.questions:
        qid = question["question_id"]
        if question["created_step"] in {st.seq for st, _ in asked}:
            assert f'asks:</span> <a href="#q-{qid}">{qid}</a> ' in \
                row(question["created_step"])
    last: dict[int, str] = {}
    moved = 0
    for st in history.steps:
        if st.confidence is None or st.hypothesis_id is None:
            continue
        assert st.confidence_before == last.get(st.hypothesis_id, "unassessed")
        if st.confidence_before != st.confidence:
            moved += 1
            assert f"<b>{st.confidence}</b><br><span class=muted>was " \
                f"{st.confidence_before}</span>" in row(st.seq)
        last[st.hypothesis_id] = st.confidence
    assert moved


def test_the_report_shows_the_evidence_each_decision_cites(
        long_run: tuple[Case, Path]) -> None:
    """A 500-step reader could not tell which evidence mattered: the evidence ids a
    decision cites for its confidence (``update.evidence_ids``) were shown nowhere. Now
    beside each step's confidence, beside each hypothesis's current confidence in the
    overview (its last decision's), and on each record (the steps citing it)."""
    case, target = long_run
    html = target.read_text(encoding="utf-8")
    history = case_history(case.store, case.case_id)

    def link(evidence_id: str) -> str:
        return f'<a href="#ev-{evidence_id}">{evidence_id}</a>'

    citing = [st for st in history.steps if st.cited_evidence]
    assert citing
    cited_at: dict[str, list[int]] = {}
    for st in citing:
        row = html.split(f'<tr id="step-{st.seq}">', 1)[1].split("</tr>", 1)[0]
        assert f"cites {', '.join(map(link, st.cited_evidence))}</span>" in row
        for evidence_id in dict.fromkeys(st.cited_evidence):
            cited_at.setdefault(evidence_id, []).append(st.seq)
    overview = html.split('<section id="overview">', 1)[1].split("</section>", 1)[0]
    for hid in history.statements:
        last = [st for st in history.steps if st.hypothesis_id == hid and st.confidence][-1]
        row = overview.split(f'<tr id="h-{hid}">', 1)[1].split("</tr>", 1)[0]
        assert f"<td>{last.confidence}<br><span class=muted>cites " \
            f"{', '.join(map(link, last.cited_evidence))}</span></td>" in row
    for e in history.evidence:
        summary = html.split(f'id="ev-{e["evidence_id"]}"><summary>', 1)[1] \
            .split("</summary>", 1)[0]
        steps = cited_at.get(e["evidence_id"], [])
        if not steps:
            assert "; cited at" not in summary
        elif len(steps) == 1:
            assert f'; cited at <a href="#step-{steps[0]}">step {steps[0]}</a>' in summary
        else:
            assert f'; cited at {len(steps)} steps: <a href="#step-{steps[0]}">' \
                f'{steps[0]}</a>, ' in summary
    from investigation.report.html import MAX_CITING_STEPS, _cited_line, _cites

    assert _cites(["E1", "E1", "E2"]).count("E1</a>") == 1  # a reply may cite one twice

    many = _cited_line(list(range(1, MAX_CITING_STEPS + 3)))
    assert many.startswith(f'; cited at {MAX_CITING_STEPS + 2} steps: <a href="#step-1">1</a>')
    assert many.endswith(f'>{MAX_CITING_STEPS}</a> and 2 more')
    # A hypothesis is named with a link to its row wherever a step, question or test
    # names it.
    first = history.steps[0]
    assert f'<a href="#h-{first.hypothesis_id}">H{first.hypothesis_id}</a>' in \
        html.split(f'<tr id="step-{first.seq}">', 1)[1].split("</tr>", 1)[0]


def test_each_step_says_why_its_hypothesis_was_selected(long_run: tuple[Case, Path]) -> None:
    """A 500-step reader could not tell why a step went to its hypothesis: the report
    shows the scheduler's rule, recorded by ``build_context`` (decision 166)."""
    case, target = long_run
    html = target.read_text(encoding="utf-8")
    steps = [st for st in case_history(case.store, case.case_id).steps
             if not st.closing_step]
    # The first turns go in id order, each naming the hypotheses still waiting.
    assert [(st.hypothesis_id, st.selection) for st in steps[:HYPOTHESES]] == [
        (i, {"rule": "first_turn", "tied": list(range(i, HYPOTHESES + 1)),
             "active": HYPOTHESES}) for i in range(1, HYPOTHESES + 1)]
    later = steps[HYPOTHESES:]
    assert later and all(st.selection and st.selection["rule"] == "highest_confidence"
                         and st.selection["tied"][0] == st.hypothesis_id for st in later)

    def row(seq: int) -> str:
        return html.split(f'<tr id="step-{seq}">', 1)[1].split("</tr>", 1)[0]

    assert "<span class=muted>selected:</span> first turn; H2, H3 have not had one yet " \
        "(lowest id goes first)" in row(steps[0].seq)
    assert "<span class=muted>selected:</span> first turn; H3 has not had one yet " \
        "(lowest id goes first)" in row(steps[1].seq)
    assert "<span class=muted>selected:</span> first turn<" in row(steps[HYPOTHESES - 1].seq)
    for st in later:
        sel = st.selection or {}
        text = f"highest confidence of {sel['active']} active: {sel['confidence']}" \
            if sel["active"] > 1 else "the only active hypothesis"
        assert f"<span class=muted>selected:</span> {text}" in row(st.seq), row(st.seq)
        if len(sel["tied"]) > 1:
            others = ", ".join(f"H{i}" for i in sel["tied"][1:])
            assert f", tied with {others} (lowest id goes first)" in row(st.seq)
    assert any(len((st.selection or {})["tied"]) > 1 for st in later)
    # The model's own note follows the selection line, labelled (a real model's user read
    # an unlabelled note as stray output).
    from investigation.report.escape import html_text

    noted = [st for st in steps if st.note]
    assert noted and all(f"<span class=muted>note:</span> {html_text(st.note)}" in row(st.seq)
                         for st in noted)


def test_a_repeated_query_names_the_record_it_repeats(tmp_path: Path) -> None:
    """A 500-step reader saw "duplicate" in the report with every finding quoted again,
    and "duplicate of E137" only in summary.md; and "resolves: Q1" with no Q1 where the
    question was asked."""
    search = {"pattern": "percent / 10"}
    replies = [
        q("source.search", search, new_questions=["Where is the divisor?"]),
        q("source.search", search, assessment=(60, ["E1"]), evidence=["E1"]),
        q("source.read", {"path": "shop/pricing.py", "start_line": 1, "end_line": 3},
          confidence="supported", assessment=(0, ["E2"]), evidence=["E1"]),
        finish("strongly_supported", (90, ["E3"]), ["E1", "E3"], resolve=["Q1"]),
    ]
    case = make_case(tmp_path / "case", replies,
                     hypotheses=[{"id": 1, "statement": "apply_discount divides by 10."}])
    outcome = case.investigator().run(case.case_id, max_steps=20)
    assert outcome.outcome == COMPLETED, outcome
    history = case_history(case.store, case.case_id)
    e1, e2 = history.evidence[0], history.evidence[1]
    assert (e1["duplicate_of"], e2["duplicate"], e2["duplicate_of"]) == (None, True, "E1")
    assert history.steps[1].found == ["1 item, 0 new", "duplicate of E1"]
    html = render_report(case.store, case.case_id)
    row2 = html.split('<tr id="step-2">', 1)[1].split("</tr>", 1)[0]
    assert 'duplicate of <a href="#ev-E1">E1</a>' in row2  # linked in its row too
    record = html.split('id="ev-E2"', 1)[1].split("</details>", 1)[0]
    assert ', duplicate of <a href="#ev-E1">E1</a>' in record
    assert 'The same findings as <a href="#ev-E1">E1</a>.' in record and "<ol" not in record
    first = html.split('id="ev-E1"', 1)[1].split("</details>", 1)[0]
    assert '<ol class="quotes">' in first and "duplicate" not in first
    row = html.split('<tr id="step-1">', 1)[1].split("</tr>", 1)[0]
    assert 'asks:</span> <a href="#q-Q1">Q1</a> Where is the divisor?' in row
    assert "; 3 iteration(s) (accepted decision rounds, the last, which ended the session, " \
        "not counted; an account&#x27;s iterations count only its queries and tests)" in html
    # The same words as summary.md.
    assert "0 new, duplicate of E1;" in summary_bytes(case.store, case.case_id).decode()


def test_the_assessed_record_is_the_pending_one_whatever_the_model_cites_first(
        tmp_path: Path) -> None:
    """An assessment may cite other records beside the pending result it must include:
    the step's "assessed" line and its refund name the record the assessment settled, not
    the first id cited."""
    import copy

    from tests import casekit

    replies = copy.deepcopy(casekit.HAPPY_REPLIES)
    replies[3]["assessment"]["evidence_ids"] = ["E1", "E2", "E3"]  # E3: H1's pending
    case = make_case(tmp_path / "c", replies=replies)
    outcome = case.investigator().run(case.case_id, max_steps=10)
    assert outcome.outcome == "COMPLETED", outcome
    step4 = next(st for st in case_history(case.store, case.case_id).steps if st.seq == 4)
    assert (step4.assessed_evidence, step4.score) == ("E3", 95)
