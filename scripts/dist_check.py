"""The distributed path on a runtime-only install (``make test-dist``).

Run by the Python of a virtual environment made with ``pip install .`` (no test extras),
in isolated mode (``python -I``) so the checkout's sources are never imported: only the
installed package and its declared dependencies. It does what an operator does:

1. ``investigate case build`` / ``db upgrade`` / ``case add`` the demo case (sqlite-utils
   3.35, its real bug) into a fresh PostgreSQL database, with
   ``INVESTIGATE_AUTO_MIGRATE=false`` so only the explicit upgrade migrates;
2. serves the demo's model replies on a loopback OpenAI-compatible server;
3. starts ``investigate worker -n dist-<id>@%h --metrics-port 0`` on Redis and
   ``investigate beat``;
4. waits for ``investigate health`` to pass (beat's heartbeat included),
   ``investigate dispatch``es the case and polls ``investigate status --json`` until
   the case is ``BUILDING_DIAGNOSIS``;
5. checks ``investigate summary`` (the defect line), ``investigate steps --json`` (every
   step, decisions citing evidence), ``investigate cases --json``, the
   worker's metrics (a COMPLETED step), that a warm shutdown (SIGTERM) exits 0, and
   that ``health`` reports no beat once beat stopped.

Settings: ``DIST_POSTGRES_URL`` (the server, default
``postgresql://postgres@127.0.0.1:5432/postgres``), ``DIST_BROKER_URL`` (default
``redis://127.0.0.1:6379/13``). Exit 0 when every check passed; 1 with the failing check
and the worker's log otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

CASE_TIMEOUT_S = 300.0


class CheckFailed(Exception):
    pass


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bin", required=True, type=Path, help="the venv's bin directory")
    parser.add_argument("--repo", required=True, type=Path, help="the checkout (workers/demo_case/)")
    parser.add_argument("--work", required=True, type=Path, help="scratch directory")
    args = parser.parse_args()
    import investigation  # the installed package, never the checkout

    here = Path(investigation.__file__).resolve()
    if here.is_relative_to(args.repo.resolve() / "investigation"):
        print(f"dist check: investigation imported from the checkout ({here})")
        return 1
    check = DistCheck(args.bin, args.repo.resolve(), args.work.resolve())
    try:
        check.run()
    except CheckFailed as exc:
        print(f"dist check FAILED: {exc}")
        check.dump_log()
        return 1
    finally:
        check.cleanup()
    print(f"dist check ok: {len(check.passed)} checks ({', '.join(check.passed)})")
    return 0


class DistCheck:
    def __init__(self, bin_dir: Path, repo: Path, work: Path) -> None:
        self.bin = bin_dir.resolve() / "investigate"
        self.repo, self.work = repo, work
        self.passed: list[str] = []
        self.run_id = uuid.uuid4().hex[:10]
        self.db_name = f"inv_dist_{self.run_id}"
        self.server_url = os.environ.get("DIST_POSTGRES_URL",
                                         "postgresql://postgres@127.0.0.1:5432/postgres")
        self.worker: subprocess.Popen[bytes] | None = None
        self.beat: subprocess.Popen[bytes] | None = None
        self.replies = None
        work.mkdir(parents=True, exist_ok=True)
        self.log_path = work / "worker.log"
        base = self.server_url.rsplit("/", 1)[0].replace("postgresql://",
                                                         "postgresql+psycopg://", 1)
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("INVESTIGATE_")}
        self.env.update({
            "INVESTIGATE_HOME": str(work / "home"),
            "INVESTIGATE_DATABASE_URL": f"{base}/{self.db_name}",
            "INVESTIGATE_BROKER_URL": os.environ.get("DIST_BROKER_URL",
                                                     "redis://127.0.0.1:6379/13"),
            "INVESTIGATE_QUEUE": f"dist-{self.run_id}",
            "INVESTIGATE_PROVIDERS": str(work / "providers.toml"),
            "INVESTIGATE_AUTO_MIGRATE": "false",
            "INVESTIGATE_LOG_FORMAT": "json",
        })

    # -- helpers ---------------------------------------------------------------------------

    def ok(self, name: str) -> None:
        self.passed.append(name)
        print(f"  ok {name}", flush=True)

    def cli(self, *argv: str, expect: int | None = 0, timeout: float = 120) -> str:
        proc = subprocess.run([str(self.bin), *argv], env=self.env, capture_output=True,
                              text=True, timeout=timeout, cwd=self.work, check=False)
        if expect is not None and proc.returncode != expect:
            raise CheckFailed(f"investigate {' '.join(argv)} exited {proc.returncode}, "
                              f"expected {expect}:\n{proc.stdout}{proc.stderr}")
        return proc.stdout

    def dump_log(self) -> None:
        if self.log_path.exists():
            print("----- worker log -----")
            print(self.log_path.read_text(errors="replace")[-20000:])

    # -- the run ---------------------------------------------------------------------------

    def demo(self) -> None:
        """`investigate demo` on the runtime install, embedded default, outside the
        checkout: the demo's files must ship in the wheel."""
        home = self.work / "demo-home"
        env = {k: v for k, v in os.environ.items() if not k.startswith("INVESTIGATE_")}
        env["INVESTIGATE_HOME"] = str(home)
        proc = subprocess.run([str(self.bin), "demo"], env=env, cwd=self.work,
                              capture_output=True, text=True, timeout=600, check=False)
        if proc.returncode != 0:
            raise CheckFailed(f"investigate demo exited {proc.returncode}:\n"
                              f"{proc.stdout}{proc.stderr}")
        if not list(home.rglob("summary.md")):
            raise CheckFailed(f"investigate demo wrote no summary.md under {home}")
        self.ok("investigate demo (embedded, runtime install)")

    def run(self) -> None:
        import psycopg

        self.demo()
        with psycopg.connect(self.server_url, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{self.db_name}"')
        self.ok("database created")
        out = self.cli("db", "current", "--check", expect=1)
        if "current none" not in out:
            raise CheckFailed(f"db current on an empty database: {out}")
        self.cli("case", "add", "x.zip", "--interpretation", "x", "--hypotheses", "x",
                 expect=2)  # not migrated yet: STORE_NOT_MIGRATED, nothing written
        self.cli("db", "upgrade")
        self.cli("db", "current", "--check")
        self.ok("db upgrade / db current")

        from workers.demo import (
            DEMO_DIR,
            DemoSource,
            fetch_source,
            providers_toml,
            replay_server,
        )

        # The demo's files come from the installed wheel, not the checkout.
        demo = DEMO_DIR
        if (self.repo / "workers").resolve() in demo.resolve().parents:
            raise CheckFailed(f"workers.demo was imported from the checkout ({demo})")
        source = fetch_source(DemoSource.load(demo), self.work / "cache")
        package = self.work / "demo-case.zip"
        self.cli("case", "build", "--source", str(source), "--report", str(demo / "report.md"),
                 "--db", str(demo / "demo.sqlite"), "--logs", str(demo / "logs"),
                 "-o", str(package))
        case_id = self.cli("case", "add", str(package), "--interpretation",
                           str(demo / "interpretation.json"), "--hypotheses",
                           str(demo / "hypotheses.json")).strip().splitlines()[-1]
        if not re.fullmatch(r"case-[0-9a-f]{16}", case_id):
            raise CheckFailed(f"case add printed {case_id!r}")
        self.ok("case build / case add")

        self.replies = replay_server(demo).start()
        (self.work / "providers.toml").write_text(providers_toml(self.replies.base_url))
        node = f"dist-{self.run_id}@%h"
        with self.log_path.open("wb") as log:
            self.worker = subprocess.Popen(
                [str(self.bin), "worker", "-n", node, "-c", "2", "--metrics-port", "0"],
                env=self.env, cwd=self.work, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True)
        with (self.work / "beat.log").open("wb") as log:
            self.beat = subprocess.Popen(
                [str(self.bin), "beat", "--schedule", str(self.work / "beat-schedule")],
                env=self.env, cwd=self.work, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True)
        deadline = time.monotonic() + 90
        while True:
            proc = subprocess.run([str(self.bin), "health", "--timeout", "1"], env=self.env,
                                  capture_output=True, text=True, check=False)
            if proc.returncode == 0:
                break
            if self.beat.poll() is not None:
                raise CheckFailed("beat exited at start:\n"
                                  + (self.work / "beat.log").read_text(errors="replace"))
            if self.worker.poll() is not None or time.monotonic() > deadline:
                raise CheckFailed(f"the worker never became healthy:\n{proc.stdout}")
            time.sleep(1)
        self.ok("worker and beat started, investigate health passes")
        port = self._metrics_port()

        self.cli("dispatch", case_id)
        deadline = time.monotonic() + CASE_TIMEOUT_S
        while True:
            info = json.loads(self.cli("status", case_id, "--json"))
            if info["state"] == "BUILDING_DIAGNOSIS":
                break
            if info["state"] != "INVESTIGATING" or time.monotonic() > deadline:
                raise CheckFailed(f"case {case_id} is {info['state']} "
                                  f"({info['blocked_reason']}, {info['blocked_detail']}) "
                                  f"after {info['steps']} steps")
            time.sleep(1)
        self.ok(f"dispatch: {case_id} reached BUILDING_DIAGNOSIS in {info['steps']} steps")
        summary = self.cli("summary", case_id)
        if "sqlite_utils/db.py:1920" not in summary:
            raise CheckFailed("summary.md does not quote sqlite_utils/db.py:1920")
        self.ok("summary quotes the defect line")
        steps = json.loads(self.cli("steps", case_id, "--json"))["steps"]
        if [row["seq"] for row in steps] != list(range(1, info["steps"] + 1)) \
                or not any(row["cited_evidence"] for row in steps):
            raise CheckFailed(f"investigate steps --json: {steps[:2]}")
        self.ok("investigate steps: every step, with the evidence decisions cite")
        rows = json.loads(self.cli("cases", "--json"))
        if [(r["case_id"], r["state"]) for r in rows] != [(case_id, "BUILDING_DIAGNOSIS")]:
            raise CheckFailed(f"investigate cases --json: {rows}")
        self.ok("investigate cases")
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
        if not re.search(rb'investigation_steps_total\{outcome="COMPLETED",reason=""\} 1\.0',
                         text):
            raise CheckFailed("the worker's metrics show no COMPLETED step:\n"
                              + text.decode()[:3000])
        self.ok("worker metrics count the steps of its prefork children")
        log_lines = [json.loads(line) for line in self.log_path.read_text().splitlines()
                     if line.startswith("{")]
        step_lines = [r for r in log_lines if r.get("case_id") == case_id]
        if not step_lines or not all(r.get("timestamp") and r.get("worker") and
                                     r.get("step") is not None for r in step_lines):
            raise CheckFailed("the worker's JSON log lines lack timestamp/worker/step")
        self.ok(f"JSON log lines with case, step, stage and worker ({len(step_lines)})")
        self.worker.send_signal(signal.SIGTERM)
        try:
            code = self.worker.wait(timeout=60)
        except subprocess.TimeoutExpired as exc:
            raise CheckFailed("the worker did not stop within 60 s of SIGTERM") from exc
        if code != 0:
            raise CheckFailed(f"the worker exited {code} after SIGTERM")
        self.ok("warm shutdown (SIGTERM) exits 0")
        self.beat.send_signal(signal.SIGTERM)
        try:
            self.beat.wait(timeout=30)
        except subprocess.TimeoutExpired as exc:
            raise CheckFailed("beat did not stop within 30 s of SIGTERM") from exc
        proc = subprocess.run([str(self.bin), "health", "--json", "--check", "beat"],
                              env=self.env, capture_output=True, text=True, check=False)
        beat = json.loads(proc.stdout)["checks"][0] if proc.stdout.startswith("{") else {}
        if proc.returncode != 1 or "run `investigate beat`" not in beat.get("detail", ""):
            raise CheckFailed(f"health did not report the stopped beat:\n{proc.stdout}")
        self.ok("health reports a stopped beat")

    def _metrics_port(self) -> int:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            found = re.search(r"metrics on http://[^:]+:(\d+)/metrics",
                              self.log_path.read_text(errors="replace"))
            if found:
                return int(found.group(1))
            time.sleep(0.2)
        raise CheckFailed("the worker never printed its metrics address")

    def cleanup(self) -> None:
        for proc in (self.worker, self.beat):
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        if self.replies is not None:
            self.replies.stop()
        import redis

        client = redis.Redis.from_url(self.env["INVESTIGATE_BROKER_URL"])
        queue = self.env["INVESTIGATE_QUEUE"]
        client.delete(queue)
        client.close()
        try:
            import psycopg

            with psycopg.connect(self.server_url, autocommit=True) as conn:
                conn.execute(f'DROP DATABASE IF EXISTS "{self.db_name}" WITH (FORCE)')
        except Exception as exc:  # leave it, say so
            print(f"dist check: could not drop database {self.db_name}: {exc}")


if __name__ == "__main__":
    sys.exit(main())
