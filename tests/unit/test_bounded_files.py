"""Files an operator names are read boundedly (``investigation.files``): a FIFO, a device
or a directory is refused without waiting, ``/dev/zero`` without reading it whole, and
each command reports its own stable code (a hostile-input trial: ``/dev/zero`` as a
policy filled memory until the kernel killed the process; a FIFO hung it)."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from investigation.files import read_bounded
from tests import casekit
from workers.cli import app

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def fifo(tmp_path: Path) -> Path:
    path = tmp_path / "fifo"
    os.mkfifo(path)
    return path


def test_read_bounded_takes_only_a_regular_file_within_its_limit(tmp_path: Path,
                                                                 fifo: Path) -> None:
    exact = tmp_path / "exact"
    exact.write_bytes(b"x" * 10)
    assert read_bounded(exact, 10) == b"x" * 10
    with pytest.raises(OSError) as big:
        read_bounded(exact, 9)
    assert big.value.errno == errno.EFBIG and "larger than 9 bytes" in str(big.value.strerror)
    for other in (fifo, Path("/dev/zero"), tmp_path):
        with pytest.raises(OSError) as refused:
            read_bounded(other, 1 << 20)
        assert refused.value.errno == errno.EINVAL, other
        assert refused.value.strerror == "not a regular file"
    with pytest.raises(FileNotFoundError):
        read_bounded(tmp_path / "missing", 10)


def _invoke(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, list(args))
    return result.exit_code, result.output


@pytest.mark.parametrize("special", ["/dev/zero", "FIFO"])
def test_commands_refuse_a_special_file_with_their_own_code(
        tmp_path: Path, fifo: Path, special: str, monkeypatch: pytest.MonkeyPatch) -> None:
    path = str(fifo) if special == "FIFO" else special
    monkeypatch.setenv("INVESTIGATE_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("INVESTIGATE_DATABASE_URL", raising=False)
    monkeypatch.delenv("INVESTIGATE_FEEDBACK_KEY", raising=False)
    package = casekit.build_tiny_package(tmp_path)
    (tmp_path / "i.json").write_text(json.dumps(casekit.INTERPRETATION))
    (tmp_path / "h.json").write_text(json.dumps(casekit.HYPOTHESES))
    add = ["case", "add", str(package), "--interpretation", str(tmp_path / "i.json"),
           "--hypotheses", str(tmp_path / "h.json")]
    code, out = _invoke(*add[:4], path, *add[5:])
    assert code == 2 and "CASE_INTERPRETATION_INVALID" in out and "not a regular file" in out
    code, out = _invoke(*add, "--package-limits", path)
    assert code == 2 and "CONFIG_UNREADABLE" in out, out
    code, out = _invoke(*add)
    assert code == 0, out
    case_id = out.strip().splitlines()[0]
    code, out = _invoke("run", case_id, "--config", path)
    assert code == 2 and "CONFIG_UNREADABLE" in out and "not a regular file" in out, out
    code, out = _invoke("run", case_id, "--providers", path)
    assert code == 2 and "CONFIG_UNREADABLE" in out, out
    code, out = _invoke("replies", "check", path, case_id)
    assert code == 2 and "SCRIPT_UNREADABLE" in out and "not a regular file" in out, out
    scripted = tmp_path / "p.toml"
    scripted.write_text(f'[[providers]]\nname = "s"\nkind = "scripted"\npath = "{path}"\n')
    code, out = _invoke("run", case_id, "--providers", str(scripted))
    assert code == 2 and "CONFIG_INVALID" in out and "is not a regular file" in out, out
    code, out = _invoke("providers", "check", "--providers", str(scripted))
    assert code == 1 and "PROVIDER_SCRIPT_UNREADABLE" in out and "not a regular file" in out
    monkeypatch.setenv("INVESTIGATE_FEEDBACK_KEY_FILE", path)
    code, out = _invoke("tests", "list", case_id)
    assert code == 2 and "CONFIG_INVALID" in out and "not a regular file" in out, out


def test_a_scripted_reply_larger_than_a_server_response_is_refused(tmp_path: Path) -> None:
    """A reply line over 16 MiB (what an HTTP provider's response may be) makes the script
    unreadable instead of being stored (a trial stored a 30 MiB reply uncompressed)."""
    from investigation.llm.scripted import read_script_lines
    from investigation.llm.types import MAX_RESPONSE_BYTES

    path = tmp_path / "replies.jsonl"
    path.write_bytes(b'{"ok": 1}\n' + b"x" * (MAX_RESPONSE_BYTES + 1) + b"\n")
    with pytest.raises(OSError) as err:
        read_script_lines(path)
    assert err.value.errno == errno.EFBIG and "reply line 2" in str(err.value.strerror)
    path.write_bytes(b'{"ok": 1}\n' + b"x" * MAX_RESPONSE_BYTES + b"\n")
    assert len(read_script_lines(path)) == 2


@pytest.mark.parametrize("digits", [4301, 5000])
def test_a_huge_integer_is_named_not_explained_in_python_terms(digits: int) -> None:
    """A reply or manifest number of more than 4,300 digits: the message names it (Python's
    own told the reader to call ``sys.set_int_max_str_digits()``, a hostile-input trial)."""
    from investigation.cases.layout import strict_json_loads
    from investigation.loop.contract import ReplyRejected, parse_reply

    with pytest.raises(ReplyRejected) as err:
        parse_reply('{"a": -' + "9" * digits + "}")
    assert err.value.code == "REPLY_NOT_JSON"
    assert f"an integer of {digits} digits (at most 4300)" in err.value.detail
    assert "sys." not in err.value.detail
    with pytest.raises(ValueError, match=f"an integer of {digits} digits"):
        strict_json_loads("[" + "9" * digits + "]")
    assert strict_json_loads("[" + "9" * 4300 + "]")[0] == int("9" * 4300)


def test_a_reply_larger_than_an_artifact_may_be_is_a_failed_attempt(tmp_path: Path) -> None:
    """Seed 000 bounds a JSON artifact (``limits.max_artifact_bytes``, 4 MiB): a model reply
    over it is a failed attempt (PROVIDER_MALFORMED_RESPONSE) whose bytes are not stored;
    a trial stored a 30 MiB reply whole, in the artifact and in the stage record."""
    from sqlmodel import select

    from investigation.store.models import Artifact, LLMAttempt, StageRun

    huge = json.dumps({"note": "x" * (5 << 20)})
    case = casekit.make_case(tmp_path / "case", replies=[huge, huge],
                             gateway_toml="[gateway]\nattempts = 2\ndelay_s = 0\n")
    outcome = case.investigator().step(case.case_id)
    assert outcome.outcome in ("BLOCKED", "RETRY_PENDING"), outcome
    with case.store.session() as s:
        attempts = s.exec(select(LLMAttempt)).all()
        sizes = [a.size_bytes for a in s.exec(select(Artifact)).all()]
        records = [len(r.output_json) for r in s.exec(select(StageRun)).all()]
    assert attempts and all(a.error_code == "PROVIDER_MALFORMED_RESPONSE" for a in attempts)
    assert all(a.response_path is None for a in attempts)
    assert max(sizes) < 4 << 20 and max(records, default=0) < 4 << 20
    assert "limits.max_artifact_bytes (4194304 bytes)" in (attempts[0].error_message or "")
    case.store.dispose()


def test_write_atomic_replaces_only_a_regular_file_and_leaves_nothing_behind(
        tmp_path: Path, fifo: Path) -> None:
    """An output path may name anything too (a hostile-input trial: `report -o /dev/full`
    as root replaced the device node with a regular file; a symlink planted at the report's
    fixed temporary name made it overwrite the file the link named)."""
    from investigation.files import write_atomic

    out = tmp_path / "out.html"
    write_atomic(out, b"one")
    assert out.read_bytes() == b"one" and out.stat().st_mode & 0o777 == 0o666 & ~_umask()
    out.chmod(0o600)
    write_atomic(out, b"two")  # replaced, with the permission bits it had
    assert out.read_bytes() == b"two" and out.stat().st_mode & 0o777 == 0o600
    for other, code in ((fifo, errno.EINVAL), (tmp_path, errno.EISDIR)):
        with pytest.raises(OSError) as refused:
            write_atomic(other, b"x")
        assert refused.value.errno == code and refused.value.filename == str(other)
    assert fifo.is_fifo()
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"precious")
    (tmp_path / "out.html.tmp").symlink_to(victim)  # the old fixed temporary name
    link = tmp_path / "link.html"
    link.symlink_to(victim)
    write_atomic(out, b"three")
    write_atomic(link, b"four")  # the link itself is replaced, not the file it names
    assert victim.read_bytes() == b"precious"
    assert not link.is_symlink() and link.read_bytes() == b"four"
    with pytest.raises(OSError) as missing:
        write_atomic(tmp_path / "missing-dir" / "x.html", b"x")
    assert missing.value.filename == str(tmp_path / "missing-dir" / "x.html")  # not the tmp
    out.chmod(0o4755)
    write_atomic(out, b"five")  # permission bits kept, never set-id
    assert out.stat().st_mode & 0o7777 == 0o755
    assert sorted(p.name for p in tmp_path.iterdir()) == \
        ["fifo", "link.html", "out.html", "out.html.tmp", "victim.txt"]


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def test_report_and_build_refuse_an_output_that_is_not_a_regular_file(
        tmp_path: Path, fifo: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INVESTIGATE_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("INVESTIGATE_DATABASE_URL", raising=False)
    package = casekit.build_tiny_package(tmp_path)
    (tmp_path / "i.json").write_text(json.dumps(casekit.INTERPRETATION))
    (tmp_path / "h.json").write_text(json.dumps(casekit.HYPOTHESES))
    code, out = _invoke("case", "add", str(package), "--interpretation",
                        str(tmp_path / "i.json"), "--hypotheses", str(tmp_path / "h.json"))
    assert code == 0, out
    case_id = out.strip().splitlines()[0]
    for target in (fifo, tmp_path):
        code, out = _invoke("report", case_id, "-o", str(target))
        assert code == 2 and "IO_ERROR" in out, out
        assert str(target) in " ".join(out.split()), out
    assert fifo.is_fifo() and not list(tmp_path.glob("*.tmp")) + list(tmp_path.glob(".*tmp"))
    source = tmp_path / "own-src"
    source.mkdir()
    (source / "app.py").write_text("print(1)\n")
    (tmp_path / "report.md").write_text("# A bug\n\nIt breaks.\n")
    code, out = _invoke("case", "build", "--source", str(source), "--report",
                        str(tmp_path / "report.md"), "-o", str(fifo))
    assert code == 2 and "not a regular file" in out, out
    assert fifo.is_fifo()


def test_a_feedback_key_file_others_can_read_is_warned_about_once(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Whoever reads the key derives every test's secret; a hostile-input trial's key file
    had mode 0644 and nothing said so. The file the engine creates is 0600."""
    from workers.settings import Settings

    made = Settings(home=tmp_path / "home")
    assert len(made.feedback_key_bytes() or b"") >= 32
    assert (tmp_path / "home" / "feedback.key").stat().st_mode & 0o777 == 0o600
    loose = tmp_path / "loose.key"
    loose.write_text("k" * 40)
    loose.chmod(0o644)
    settings = Settings(home=tmp_path / "home", feedback_key_file=loose)
    for _ in range(3):
        assert settings.feedback_key_bytes() == b"k" * 40
    said = [r.getMessage() for r in caplog.records if "feedback key file" in r.getMessage()]
    assert said == [f"feedback key file {loose} has mode 0644: other users can read it and "
                    f"forge test feedback; `chmod 600 {loose}`"]


def test_healths_advice_on_a_file_edited_under_running_workers(tmp_path: Path) -> None:
    """'restart them' only when a restarted worker would start: a file that no longer
    loads, or whose scripted reply file is gone, or that the worker cannot read, is to be
    fixed first (a fleet trial restarted into workers that refused to start; a review)."""
    from workers.health import _reload_advice

    policy = tmp_path / "policy.toml"
    policy.write_text("[budget]\ncredit_units = 30\n")
    assert _reload_advice("policy", str(policy), "abc") == "restart them to load it"
    policy.write_text("[budget]\ncredit_units = 30\n[budget]\n")
    assert _reload_advice("policy", str(policy), "abc").startswith(
        "and it does not load now: CONFIG_INVALID")
    providers = tmp_path / "providers.toml"
    providers.write_text('[[providers]]\nname = "r"\nkind = "scripted"\npath = "gone.jsonl"\n')
    advice = _reload_advice("providers", str(providers), "abc")
    assert "does not load now" in advice and "gone.jsonl" in advice and "fix it first" in advice
    (tmp_path / "gone.jsonl").write_text("")
    assert _reload_advice("providers", str(providers), "abc") == "restart them to load it"
    assert _reload_advice("providers", str(providers), "unreadable").startswith(
        "and the worker cannot read it now")
    assert _reload_advice("policy", str(tmp_path / "elsewhere.toml"), "abc") == \
        "restart them to load it"  # not on this host: nothing to check here
