"""An operator's fleet, for real: ``investigate worker`` (prefork, Redis), ``investigate
flower`` with a login, ``investigate metrics``, a case that blocks, found with
``investigate cases``, in Flower and in the metrics, then resumed to the end.

Also: node names are unique, a dispatch sent by a process that has only Celery installed
runs the case (the upstream message contract), and the deploy script works on one
machine (refuses a second start, waits for its workers on stop).
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from investigation.constants import CASE_BLOCKED, CASE_BUILDING_DIAGNOSIS
from tests.casekit import HAPPY_REPLIES
from tests.integration.test_celery_worker import REPO, Worker, running_harness

pytestmark = [pytest.mark.redis, pytest.mark.slow]

BIN = Path(sys.executable).parent / "investigate"
INVALID = "this is not a JSON reply"
AUTH = "operator:s3cret-pass"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http_get(url: str, auth: str | None = None, timeout_s: float = 5.0) -> tuple[int, bytes]:
    request = urllib.request.Request(url)
    if auth:
        request.add_header("Authorization",
                           "Basic " + base64.b64encode(auth.encode()).decode())
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return int(response.status), response.read()
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read()


def wait_http(url: str, auth: str | None = None, timeout_s: float = 40.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            status, _ = http_get(url, auth, timeout_s=2)
            if status == 200:
                return
        except OSError:
            pass
        assert time.monotonic() < deadline, f"{url} did not answer 200 in time"
        time.sleep(0.3)


def cli(env: dict[str, str], *argv: str, expect: int = 0) -> str:
    proc = subprocess.run([str(BIN), *argv], env=env, capture_output=True, text=True,
                          timeout=120, check=False, cwd=REPO)
    assert proc.returncode == expect, (argv, proc.returncode, proc.stdout, proc.stderr)
    return proc.stdout + proc.stderr


def metric(text: str, name: str, **labels: str) -> float | None:
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))  # as exposed
    pattern = rf"^{re.escape(name)}{re.escape('{' + want + '}') if want else ''} (\S+)$"
    found = re.search(pattern, text, re.M)
    return float(found.group(1)) if found else None


class Server:
    """A long-running CLI process (Flower, the metrics exporter) and its log."""

    def __init__(self, argv: list[str], env: dict[str, str], log: Path) -> None:
        self.log_path = log
        with log.open("ab") as fh:
            self.proc = subprocess.Popen([str(BIN), *argv], env=env, cwd=REPO, stdout=fh,
                                         stderr=subprocess.STDOUT, start_new_session=True)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def test_an_operator_sees_a_blocked_case_everywhere_and_resumes_it(
    tmp_path: Path, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from workers.tasks import start_dispatch

    replies = [INVALID] * 3 + HAPPY_REPLIES  # three rejected replies block the case
    with running_harness(tmp_path, redis_url, monkeypatch, replies=replies) as h:
        env = dict(h.worker.env)
        flower_port, metrics_port = free_port(), free_port()
        worker = Worker([str(BIN), "worker", "-n", f"{h.queue}-a@%h", "-c", "2",
                         "--metrics-port", "0"], env, tmp_path / "cli-worker.log")
        h.worker = worker  # the harness stops it
        flower = Server(["flower", "--port", str(flower_port), "--basic-auth", AUTH], env,
                        tmp_path / "flower.log")
        exporter = Server(["metrics", "--port", str(metrics_port)], env,
                          tmp_path / "metrics.log")
        try:
            with h.dump_on_failure():
                worker.start()
                worker.wait_ready()
                wait_http(f"http://127.0.0.1:{flower_port}/workers", AUTH)
                assert http_get(f"http://127.0.0.1:{flower_port}/workers")[0] == 401
                worker_metrics = re.search(r"metrics on (http://\S+/metrics)",
                                           worker.log())
                assert worker_metrics, worker.log()
                # Flower subscribes to events every few seconds: give it one round.
                time.sleep(3)

                token = start_dispatch(h.case.case_id)
                assert isinstance(token, str)
                info = h.wait_for_state(CASE_BLOCKED)
                assert info["blocked_reason"] == "INVALID_LLM_RESPONSES"
                h.wait_unlocked()

                # investigate cases --state blocked finds it, with its reason.
                rows = json.loads(cli(env, "cases", "--state", "blocked", "--json"))
                assert [(r["case_id"], r["state"], r["blocked_reason"]) for r in rows] == [
                    (h.case.case_id, "BLOCKED", "INVALID_LLM_RESPONSES")]
                assert rows[0]["steps"] == 3 and rows[0]["hypotheses"] == 2
                assert rows[0]["last_outcome"] == "BLOCKED"
                # what to do next: the guidance's first step (fix the model, then resume)
                assert rows[0]["next"] and h.case.case_id in rows[0]["next"]
                table = cli(env, "cases")
                assert h.case.case_id in table and "INVALID_LLM_RESPONSES" in table
                assert f"next for {h.case.case_id}: " in table
                assert json.loads(cli(env, "cases", "--state", "paused", "--json")) == []
                assert "STATE_UNKNOWN" in cli(env, "cases", "--state", "nope", expect=2)

                # Flower: a search for BLOCKED finds the step's tasks; their arguments say
                # which case, step and stage; the lock token is never shown whole.
                deadline = time.monotonic() + 20
                while True:
                    status, body = http_get(
                        f"http://127.0.0.1:{flower_port}/api/tasks?search=result:BLOCKED",
                        AUTH)
                    assert status == 200
                    tasks = json.loads(body)
                    if any(t["name"] == "investigation.llm_call" or
                           t["name"] == "investigation.publish" for t in tasks.values()):
                        break
                    assert time.monotonic() < deadline, tasks
                    time.sleep(0.5)
                blocked = [t for t in tasks.values()
                           if "INVALID_LLM_RESPONSES" in (t.get("result") or "")]
                assert blocked, tasks
                assert all(t["result"].startswith("{'halt': {'outcome': 'BLOCKED', "
                                                  "'reason': 'INVALID_LLM_RESPONSES'")
                           for t in blocked), blocked
                page = http_get(f"http://127.0.0.1:{flower_port}/tasks", AUTH)[1].decode()
                assert ">args<" in page and ">Result<" in page  # listed on the tasks page
                for t in blocked:
                    assert f"case={h.case.case_id}" in t["args"], t
                    assert re.search(r"step=\d+ stage=\w+", t["args"]), t
                everything = http_get(f"http://127.0.0.1:{flower_port}/api/tasks", AUTH)[1]
                assert token not in everything.decode()
                shown = repr({"token": token[:8] + "…"})
                assert any(t["kwargs"] == shown for t in json.loads(everything).values())

                # Metrics: the worker counted the steps; the exporter shows the block.
                text = http_get(worker_metrics.group(1))[1].decode()
                assert metric(text, "investigation_steps_total", outcome="REJECTED",
                              reason="REPLY_NOT_JSON") == 2.0, text
                assert metric(text, "investigation_steps_total", outcome="BLOCKED",
                              reason="INVALID_LLM_RESPONSES") == 1.0, text
                assert (metric(text, "investigation_stage_duration_seconds_count",
                               stage="llm_call", result="ok") or 0) >= 2, text
                wait_http(f"http://127.0.0.1:{metrics_port}/metrics")
                store_text = http_get(f"http://127.0.0.1:{metrics_port}/metrics")[1].decode()
                assert metric(store_text, "investigation_blocked_cases",
                              reason="INVALID_LLM_RESPONSES") == 1.0, store_text
                assert metric(store_text, "investigation_cases", state="BLOCKED") == 1.0
                assert metric(store_text, "investigation_store_up") == 1.0
                assert metric(store_text, "investigation_queue_messages",
                              queue=h.queue) == 0.0

                # Logs: timestamps, the step context, the token only shortened.
                log = worker.log()
                assert token not in log
                assert re.search(
                    rf"^\d{{4}}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{{3}}\+00:00 \w+ \S+ "
                    rf"\[worker={re.escape(h.queue)}-a@\S+ case={h.case.case_id} step=1 "
                    rf"stage=llm_call\]", log, re.M), log[-3000:]

                # The operator fixes the cause (here: the script goes on with valid
                # replies), resumes and dispatches; the case completes.
                cli(env, "resume", h.case.case_id)
                cli(env, "dispatch", h.case.case_id)
                h.wait_for_state(CASE_BUILDING_DIAGNOSIS)
                store_text = http_get(f"http://127.0.0.1:{metrics_port}/metrics")[1].decode()
                assert metric(store_text, "investigation_cases",
                              state="BUILDING_DIAGNOSIS") == 1.0
                assert metric(store_text, "investigation_blocked_cases",
                              reason="INVALID_LLM_RESPONSES") is None
                text = http_get(worker_metrics.group(1))[1].decode()
                assert metric(text, "investigation_steps_total", outcome="COMPLETED",
                              reason="") == 1.0
                assert (metric(text, "investigation_units_spent_total") or 0) > 0
                assert (metric(text, "investigation_model_calls_total", provider="replay",
                               status="succeeded", code="") or 0) >= 8, text
                rows = json.loads(cli(env, "cases", "--json"))
                assert rows[0]["state"] == "BUILDING_DIAGNOSIS"
                assert rows[0]["balance_units"] < rows[0]["credit_units"]
        finally:
            flower.stop()
            exporter.stop()


def test_a_second_worker_under_a_taken_node_name_is_refused(
    tmp_path: Path, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with running_harness(tmp_path, redis_url, monkeypatch) as h, h.dump_on_failure():
        h.worker.start()
        h.worker.wait_ready()
        out = cli(dict(h.worker.env), "worker", "-n", f"{h.queue}@%h", expect=2)
        assert "WORKER_NAME_TAKEN" in out
        health = json.loads(cli(dict(h.worker.env), "health", "--json", "--check", "workers",
                                "--check", "queue", "--check", "broker"))
        assert health["healthy"] is True
        names = next(c["value"] for c in health["checks"] if c["name"] == "workers")
        assert any(n.startswith(f"{h.queue}@") for n in names)
        # A queue no worker reads: dispatches there would wait forever.
        elsewhere = {**dict(h.worker.env), "INVESTIGATE_QUEUE": f"{h.queue}-nobody"}
        out = cli(elsewhere, "health", "--json", "--check", "workers", "--check", "broker",
                  expect=1)
        workers = next(c for c in json.loads(out)["checks"] if c["name"] == "workers")
        assert workers["ok"] is False and workers["value"] == []
        assert f"0 consume queue '{h.queue}-nobody'" in workers["detail"]
        assert f"INVESTIGATE_QUEUE={h.queue}-nobody" in workers["detail"]


@pytest.mark.fleet  # over half a minute of real workers and health runs
def test_health_names_workers_of_one_queue_that_disagree_on_their_files_or_store(
    tmp_path: Path, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two fleet trials ran a worker with another policy file, another providers file,
    another database or another lock Redis beside its fleet, and nothing showed it
    (`health` was green). The workers of a queue now report where their state and locks
    are and digests of their files (`inspect`), and `health` fails naming what differs."""
    from dataclasses import replace

    policy = tmp_path / "other-policy.toml"
    policy.write_text("[budget]\ncredit_units = 20\n")
    with running_harness(tmp_path, redis_url, monkeypatch) as h, h.dump_on_failure():
        h.worker.start()
        h.worker.wait_ready()
        env = dict(h.worker.env)
        checks = ("health", "--json", "--check", "workers", "--check", "broker")
        agreed = json.loads(cli(env, *checks))
        assert agreed["healthy"] is True, agreed
        # A worker started without the fleet's INVESTIGATE_HOME makes its own feedback
        # key and refuses every secret the operators' shell shows (a fleet trial).
        other = replace(h.worker, env={**env, "INVESTIGATE_CONFIG": str(policy),
                                       "INVESTIGATE_FEEDBACK_KEY_FILE": str(tmp_path / "k2")},
                        log_path=tmp_path / "other-worker.log",
                        cmd=[*h.worker.cmd[:-1], f"other-{h.queue}@%h"])
        other.start()
        try:
            other.wait_ready()
            out = json.loads(cli(env, *checks, expect=1))
            workers = next(c for c in out["checks"] if c["name"] == "workers")
            assert workers["ok"] is False and len(workers["value"]) == 2, workers
            assert "workers disagree on their policy" in workers["detail"], workers
            assert f"({policy})" in workers["detail"], workers  # which file, not only a digest
            assert "none" in workers["detail"] and "store" not in workers["detail"]
            assert "workers disagree on their feedback key" in workers["detail"], workers
            assert f"({tmp_path / 'k2'})" in workers["detail"], workers
            assert "give every worker and this shell the same INVESTIGATE_FEEDBACK_KEY_FILE" \
                in workers["detail"], workers
            assert "changed on disk" not in workers["detail"]
            # Edited after the worker read it (a fleet trial edited the providers file and
            # restarted one worker: every worker hashed the file as it was at the check).
            policy.write_text("[budget]\ncredit_units = 30\n")
            out = json.loads(cli(env, *checks, expect=1))
            detail = next(c for c in out["checks"] if c["name"] == "workers")["detail"]
            assert f"the policy file changed on disk since other-{h.queue}@" in detail, detail
            assert "restart them to load it" in detail, detail
            # Broken since: a restart would be refused, so health says to fix it first
            # (a fleet trial restarted into a fleet that would not start).
            policy.write_text("[budget]\ncredit_units = 30\n[budget]\n")
            out = json.loads(cli(env, *checks, expect=1))
            detail = next(c for c in out["checks"] if c["name"] == "workers")["detail"]
            assert "and it does not load now: CONFIG_INVALID" in detail, detail
            assert "fix it first" in detail and "restart them to load it" not in detail
            shell = {**env, "INVESTIGATE_DATABASE_URL": f"sqlite:///{tmp_path / 'x.db'}"}
            out = json.loads(cli(shell, *checks, expect=1))
            detail = next(c for c in out["checks"] if c["name"] == "workers")["detail"]
            assert "the workers' store is" in detail and "x.db" in detail, detail
        finally:
            other.stop()
        # This shell with another key: a secret `tests list` shows here is refused there.
        (tmp_path / "other.key").write_text("0" * 64 + "\n")
        (tmp_path / "other.key").chmod(0o600)
        lone = {**env, "INVESTIGATE_FEEDBACK_KEY_FILE": str(tmp_path / "other.key")}
        out = json.loads(cli(lone, *checks, expect=1))
        detail = next(c for c in out["checks"] if c["name"] == "workers")["detail"]
        assert "the workers' feedback key is " in detail and "this shell's " in detail \
            and f"({tmp_path / 'other.key'})" in detail, detail
        # A shell without any key shows no secret: not a failure, and health makes none.
        keyless = {**env, "INVESTIGATE_FEEDBACK_KEY_FILE": str(tmp_path / "missing.key")}
        assert json.loads(cli(keyless, *checks))["healthy"] is True
        assert not (tmp_path / "missing.key").exists()
        # This shell names another providers file than the workers started with (a fleet
        # trial pointed INVESTIGATE_PROVIDERS elsewhere; health said ok).
        theirs = Path(env["INVESTIGATE_PROVIDERS"])
        mine = tmp_path / "mine.toml"
        mine.write_text(theirs.read_text() + "# another file\n")
        out = json.loads(cli({**env, "INVESTIGATE_PROVIDERS": str(mine)}, *checks, expect=1))
        detail = next(c for c in out["checks"] if c["name"] == "workers")["detail"]
        assert f"the workers' providers file is {theirs} (" in detail, detail
        assert f"this shell's {mine} (" in detail and "restart the workers" in detail, detail


UPSTREAM_VENV = REPO / "var" / "test-upstream-venv"
UPSTREAM_SCRIPT = """
import json, sys
from celery import Celery
try:
    import investigation  # noqa: F401
    sys.exit("the upstream process must not have the engine installed")
except ImportError:
    pass
broker, queue, case_id = sys.argv[1:4]
app = Celery("upstream", broker=broker)
app.conf.update(task_serializer="json", accept_content=["json"])
result = app.send_task("investigation.dispatch", args=[case_id], kwargs={"contract": 1},
                       queue=queue)
print(result.id)
"""


def upstream_python() -> Path:
    """A virtual environment with only ``celery[redis]`` (made once, reused)."""
    python = UPSTREAM_VENV / "bin" / "python"
    ok = python.exists() and subprocess.run(
        [str(python), "-c", "import celery, redis"], capture_output=True,
        check=False).returncode == 0
    if not ok:
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(UPSTREAM_VENV)],
                       check=True)
        subprocess.run([str(python), "-m", "pip", "install", "--quiet", "celery[redis]"],
                       check=True, timeout=600)
    return python


def test_a_dispatch_sent_by_a_process_with_only_celery_runs_the_case(
    tmp_path: Path, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    python = upstream_python()
    with running_harness(tmp_path, redis_url, monkeypatch) as h, h.dump_on_failure():
        h.worker.start()
        h.worker.wait_ready()
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("INVESTIGATE_", "PYTHON"))}
        sent = subprocess.run([str(python), "-I", "-c", UPSTREAM_SCRIPT, h.broker_url,
                               h.queue, h.case.case_id], env=env, capture_output=True,
                              text=True, timeout=60, check=False, cwd=tmp_path)
        assert sent.returncode == 0, sent.stderr
        info = h.wait_for_state(CASE_BUILDING_DIAGNOSIS)
        assert info["steps"] == 5
        # The last step's `advance` releases the lock just after the state is published:
        # a dispatch before that is LOCK_BUSY (a clean-clone CI under load met it).
        h.wait_unlocked()
        # A message of an unknown contract version is refused, visibly, and runs nothing.
        from workers.tasks import dispatch

        assert dispatch.apply(args=(h.case.case_id,), kwargs={"contract": 2}).get() == {
            "outcome": "CONTRACT_UNSUPPORTED", "case_id": h.case.case_id, "contract": 2}
        # A case with nothing to run says so: a completed case's result read DISPATCHED
        # (a fleet trial), while `investigate dispatch` said "nothing to dispatch".
        assert dispatch.apply(args=(h.case.case_id,)).get() == {
            "case_id": h.case.case_id, "outcome": "NOTHING_TO_RUN",
            "case_outcome": "COMPLETED", "reason": "ALL_ACCOUNTS_TERMINAL"}


@pytest.mark.fleet
def test_cluster_sh_starts_only_what_is_dead_and_waits_for_its_workers_on_stop(
    tmp_path: Path, redis_url: str, postgres_url: str
) -> None:
    from tests.integration.test_celery_worker import _broker_url

    db = "inv_cluster_" + os.urandom(4).hex()
    subprocess.run(["dropdb", "-h", "127.0.0.1", "-U", "postgres", "--if-exists", db],
                   check=False, capture_output=True)
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith("INVESTIGATE_")}
    env.update({
        "CLUSTER_ENV": str(tmp_path / "no-cluster.env"),  # not a checkout's own file
        "INVESTIGATE_RUN_DIR": str(run_dir),
        "INVESTIGATE_BIN": str(BIN),
        "INVESTIGATE_DATABASE_URL": f"postgresql+psycopg://postgres@127.0.0.1:5432/{db}",
        "INVESTIGATE_BROKER_URL": _broker_url(redis_url),
        "INVESTIGATE_QUEUE": f"cluster-{os.urandom(4).hex()}",
        "WORKER_CONCURRENCY": "1",
        "WORKER_METRICS_BASE_PORT": str(free_port() - 1),
        "METRICS_PORT": str(free_port()),
        "FLOWER_PORT": str(free_port()),
        "STOP_TIMEOUT_S": "60",
    })
    script = ["bash", str(REPO / "deploy" / "cluster.sh")]
    try:
        started = subprocess.run([*script, "start", "1"], env=env, capture_output=True,
                                 text=True, timeout=120, check=False)
        assert started.returncode == 0, started.stdout + started.stderr
        pids = {p.stem: int(p.read_text()) for p in run_dir.glob("*.pid")}
        assert set(pids) == {"worker-1", "beat", "metrics", "flower"}
        again = subprocess.run([*script, "start", "1"], env=env, capture_output=True,
                               text=True, timeout=60, check=False)
        assert again.returncode == 0 and "nothing to start" in again.stdout, again
        assert {p.stem: int(p.read_text()) for p in run_dir.glob("*.pid")} == pids
        deadline = time.monotonic() + 60
        while " ready." not in (run_dir / "worker-1.log").read_text(errors="replace"):
            assert time.monotonic() < deadline, (run_dir / "worker-1.log").read_text()
            time.sleep(0.3)
        assert "worker1@" in (run_dir / "worker-1.log").read_text()
        # A fleet trial's beat died: `start` refused while the rest ran, and every start
        # emptied the logs the operator needed.
        os.kill(pids["beat"], 15)
        deadline = time.monotonic() + 30
        while Path(f"/proc/{pids['beat']}").exists() and \
                Path(f"/proc/{pids['beat']}/stat").read_text().split()[2] != "Z":
            assert time.monotonic() < deadline
            time.sleep(0.2)
        dead = subprocess.run([*script, "status"], env=env, capture_output=True, text=True,
                              timeout=60, check=False)
        # A dead process fails the status (a fleet trial's dead worker exited 0).
        assert "beat dead" in dead.stdout and dead.returncode == 1, dead
        assert "starts only what is dead" in dead.stderr, dead
        revived = subprocess.run([*script, "start", "1"], env=env, capture_output=True,
                                 text=True, timeout=120, check=False)
        assert revived.returncode == 0, revived.stdout + revived.stderr
        assert "started: beat (already running: worker-1 metrics flower)" in revived.stdout
        now = {p.stem: int(p.read_text()) for p in run_dir.glob("*.pid")}
        assert now["beat"] != pids["beat"] and {k: v for k, v in now.items() if k != "beat"} \
            == {k: v for k, v in pids.items() if k != "beat"}
        assert (run_dir / "beat.log").read_text().count("cluster.sh start") == 2
        pids = now
        # One worker fewer: `start 1` named the second worker nowhere and nothing stopped
        # it alone (a fleet trial); `stop NAME` stops the processes named.
        more = subprocess.run([*script, "start", "2"], env=env, capture_output=True,
                              text=True, timeout=120, check=False)
        assert more.returncode == 0 and "started: worker-2 (" in more.stdout, more
        fewer = subprocess.run([*script, "start", "1"], env=env, capture_output=True,
                               text=True, timeout=60, check=False)
        assert fewer.returncode == 0 and "nothing to start" in fewer.stdout, fewer
        assert "also running, beyond the 1 worker(s) asked for: worker-2 (" in fewer.stdout
        assert "cluster.sh stop worker-2' stops them)" in fewer.stdout, fewer
        second = int((run_dir / "worker-2.pid").read_text())
        one = subprocess.run([*script, "stop", "worker-2"], env=env, capture_output=True,
                             text=True, timeout=120, check=False)
        assert one.returncode == 0 and "stopped: worker-2 (" in one.stdout, one
        assert not Path(f"/proc/{second}").exists() or \
            Path(f"/proc/{second}/stat").read_text().split()[2] == "Z"
        assert {p.stem: int(p.read_text()) for p in run_dir.glob("*.pid")} == pids
        assert subprocess.run([*script, "status"], env=env, capture_output=True,
                              timeout=60, check=False).returncode == 0
        unknown = subprocess.run([*script, "stop", "worker-9"], env=env, capture_output=True,
                                 text=True, timeout=60, check=False)
        assert unknown.returncode == 2 and "'worker-9' is not one of" in unknown.stderr
        stopped = subprocess.run([*script, "stop"], env=env, capture_output=True, text=True,
                                 timeout=120, check=False)
        assert stopped.returncode == 0, stopped.stdout + stopped.stderr
        for name, pid in pids.items():  # every process has exited when stop returns
            assert not Path(f"/proc/{pid}").exists() or \
                Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z", name
        assert not list(run_dir.glob("*.pid"))
    finally:
        for pidfile in run_dir.glob("*.pid"):
            with contextlib.suppress(OSError, ValueError):
                os.kill(int(pidfile.read_text()), 9)
        subprocess.run(["dropdb", "-h", "127.0.0.1", "-U", "postgres", "--if-exists",
                        "--force", db], check=False, capture_output=True)


@pytest.mark.fleet
def test_cluster_sh_takes_the_callers_environment_over_its_env_file(tmp_path: Path) -> None:
    """``deploy/cluster.sh`` reads ``cluster.env`` (or ``CLUSTER_ENV``) for what the
    caller did not set: a variable in the environment keeps its value."""
    env_file = tmp_path / "cluster.env"
    env_file.write_text(f"INVESTIGATE_RUN_DIR={tmp_path / 'from-file'}\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("INVESTIGATE_")}
    env["CLUSTER_ENV"] = str(env_file)
    script = ["bash", str(REPO / "deploy" / "cluster.sh"), "status"]
    from_file = subprocess.run(script, env=env, capture_output=True, text=True, timeout=30,
                               check=False)
    assert from_file.returncode == 3, from_file.stderr  # nothing started (LSB's 3)
    assert f"no pid files in {tmp_path / 'from-file'}" in from_file.stdout
    env["INVESTIGATE_RUN_DIR"] = str(tmp_path / "from-caller")
    from_caller = subprocess.run(script, env=env, capture_output=True, text=True, timeout=30,
                                 check=False)
    assert from_caller.returncode == 3, from_caller.stderr
    assert f"no pid files in {tmp_path / 'from-caller'}" in from_caller.stdout
    # A caller that exports bash's read-only option variables (to pass `set -e` on).
    env["SHELLOPTS"] = "braceexpand:errexit:hashall:interactive-comments"
    readonly = subprocess.run(script, env=env, capture_output=True, text=True, timeout=30,
                              check=False)
    assert readonly.returncode == 3, readonly.stderr
    assert f"no pid files in {tmp_path / 'from-caller'}" in readonly.stdout


def test_flower_refuses_to_listen_beyond_loopback_without_a_login(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("INVESTIGATE_", "FLOWER_"))}
    env["INVESTIGATE_HOME"] = str(tmp_path)
    out = cli(env, "flower", "--address", "0.0.0.0", "--port", str(free_port()), expect=2)
    assert "FLOWER_AUTH_REQUIRED" in out
    out = cli(env, "flower", "--basic-auth", "nopassword", expect=2)
    assert "USER:PASSWORD" in out
    for blank in (":", "ops:", ":secret", "ops:secret,:"):  # not a login at all
        out = cli({**env, "FLOWER_BASIC_AUTH": blank}, "flower", "--address", "0.0.0.0",
                  "--port", str(free_port()), expect=2)
        assert "FLOWER_AUTH_INVALID" in out, blank
    # A port already taken: said with the address, as the exporter says it (a fleet
    # trial got "Address already in use" alone).
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = cli(env, "flower", "--port", str(port), expect=2)
    assert f"error IO_ERROR: cannot serve Flower on 127.0.0.1:{port}: Address already in " \
        "use" in out, out


@pytest.mark.parametrize(("url", "shown", "secret"), [
    ("redis://:p@ss@host:6379/0", "redis://:***@host:6379/0", "p@ss"),
    ("redis://user:se@cr@et@h/1", "redis://user:***@h/1", "se@cr@et"),
    ("postgresql+psycopg://u:pw9@127.0.0.1:5432/test",
     "postgresql+psycopg://u:***@127.0.0.1:5432/test", "pw9"),
    ("redis://:pa/ss@h:1/0", "redis://***", "pa/ss"),  # an @ past the authority
    ("sqlite:////tmp/x.db", "sqlite:////tmp/x.db", None),
    ("redis://h:6379/0", "redis://h:6379/0", None),
    # libpq's password parameter (a hostile trial: status, health and db echoed it).
    ("postgresql+psycopg://postgres@h:5432/a?password=s3cretpw&connect_timeout=3",
     "postgresql+psycopg://postgres@h:5432/a?password=***&connect_timeout=3", "s3cretpw"),
    ("postgresql://u:pw7@h/a?sslmode=require&sslpassword=k3y#x",
     "postgresql://u:***@h/a?sslmode=require&sslpassword=***#x", "k3y"),
])
def test_health_never_shows_a_password(url: str, shown: str, secret: str | None) -> None:
    from investigation.text_safety import url_for_display, url_location
    from workers.health import _first_line_of

    assert url_for_display(url) == shown
    # Where a message names the store (STORE_NOT_FOUND, CASE_NOT_FOUND, the worker's log).
    assert url_location(url) == shown.split("@")[-1]
    line = _first_line_of(ConnectionError(f"cannot reach {url}: refused"), url)
    assert line == f"cannot reach {shown}: refused"
    if secret:
        assert secret not in line


def test_a_missing_module_is_reported_as_a_missing_module(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("INVESTIGATE_")}
    env["INVESTIGATE_HOME"] = str(tmp_path)
    code = ("import sys; sys.modules['packaging'] = None; sys.argv = ['investigate', "
            "'health', '--check', 'broker']; from workers.cli import main; main()")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=60, check=False, cwd=REPO)
    assert proc.returncode == 2, proc.stderr
    assert "DEPENDENCY_MISSING" in proc.stderr and "'packaging'" in proc.stderr
    assert "kombu" in proc.stderr and "CONFIG_INVALID" not in proc.stderr


@pytest.mark.fleet  # over half a minute of real workers and health runs
def test_health_sees_whether_a_beat_runs(tmp_path: Path, redis_url: str) -> None:
    """A fleet trial killed beat and `health` stayed green, while no added case started by
    itself and no case was taken up after its worker died. Beat now leaves a heartbeat in
    the lock Redis; `health` fails without one, with two, and with one that sends to
    another broker (decision 160)."""
    import redis

    queue = f"beat-{os.getpid()}-{time.monotonic_ns()}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("INVESTIGATE_")}
    env.update({"INVESTIGATE_HOME": str(tmp_path / "home"), "INVESTIGATE_BROKER_URL": redis_url,
                "INVESTIGATE_QUEUE": queue,
                "INVESTIGATE_DATABASE_URL": f"sqlite:///{tmp_path / 'store.db'}"})
    key = f"investigation:beat:{queue}"
    client = redis.Redis.from_url(redis_url)
    checks = ("health", "--json", "--check", "locks", "--check", "beat")

    def beat_check(shell: dict[str, str] = env, expect: int = 0) -> dict[str, Any]:
        return json.loads(cli(shell, *checks, expect=expect))["checks"][1]

    def start_beat(name: str, extra: dict[str, str] | None = None) -> Server:
        beat = Server(["beat", "--schedule", str(tmp_path / f"{name}-schedule")],
                      {**env, **(extra or {})}, tmp_path / f"{name}.log")
        deadline = time.monotonic() + 30
        while not any(f.endswith(f":{beat.proc.pid}".encode()) for f in client.hkeys(key)):
            assert beat.proc.poll() is None, beat.log_path.read_text()
            assert time.monotonic() < deadline, beat.log_path.read_text()
            time.sleep(0.1)
        return beat

    try:
        none = beat_check(expect=1)
        assert none["ok"] is False and "run `investigate beat`" in none["detail"], none
        off = json.loads(cli({**env, "INVESTIGATE_SWEEP_INTERVAL_S": "0"}, *checks))
        assert "recovery sweeps are off" in off["checks"][1]["detail"]
        first = start_beat("first")
        try:
            seen = beat_check()
            assert seen["ok"] and f"(pid {first.proc.pid})" in seen["detail"], seen
            assert 0 < (client.ttl(key) or 0) <= 60
            # Redis lost its keys (a flush): no heartbeat until the beat's next one, and
            # the advice said to start a beat, which would make two (a fleet trial).
            client.delete(key)
            lost = beat_check(expect=1)["detail"]
            assert "lost its keys" in lost and "at most 20 s later" in lost, lost
            deadline = time.monotonic() + 30
            while not client.exists(key):
                assert time.monotonic() < deadline, "the beat left no new heartbeat"
                time.sleep(0.2)
            assert beat_check()["ok"]
            # A second `investigate beat` is refused (a fleet trial started one beside the
            # cluster's; only health said so).
            elsewhere = redis_url.rsplit("/", 1)[0] + "/7"  # sweeps off: nothing sent there
            second = Server(["beat", "--schedule", str(tmp_path / "second-schedule")],
                            {**env, "INVESTIGATE_BROKER_URL": elsewhere,
                             "INVESTIGATE_REDIS_URL": redis_url},
                            tmp_path / "second.log")
            assert second.proc.wait(timeout=60) == 2
            said = " ".join(second.log_path.read_text().split())
            assert "BEAT_RUNNING" in said and f"(pid {first.proc.pid}," in said, said
            # A fleet re-trial: a second beat (a worker's --beat, say), one sending
            # elsewhere, one with sweeps off: its heartbeat, as a beat of this host writes it.
            client.hset(key, f"{socket.gethostname()}:{os.getpid()}", json.dumps({
                "host": socket.gethostname(), "pid": os.getpid(), "broker": elsewhere,
                "sweep_interval_s": 0, "ts": time.time(), "at": "now"}))
            try:
                two = beat_check(expect=1)["detail"]
                assert "2 beats run" in two and "sends its sweeps to" in two, two
                assert "runs with INVESTIGATE_SWEEP_INTERVAL_S=0" in two, two
            finally:
                client.hdel(key, f"{socket.gethostname()}:{os.getpid()}")
            assert beat_check()["ok"]
        finally:
            first.proc.kill()  # no clean stop: its heartbeat stays in Redis
            first.proc.wait()
        assert client.hlen(key) == 1
        gone = beat_check(expect=1)  # this host sees its process is gone
        assert "run `investigate beat`" in gone["detail"], gone
        clean = start_beat("clean")
        clean.stop()
        assert clean.proc.returncode == 0
        assert f":{clean.proc.pid}".encode() not in b" ".join(client.hkeys(key))
    finally:
        client.delete(key)
        client.close()
