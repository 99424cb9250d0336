"""The cyclic collector's threshold in processes that run stages (decision 131).

Each check runs in a fresh interpreter: the collector's settings are process-wide, and a
worker's children inherit them through ``fork``.
"""

from __future__ import annotations

import ast
import gc
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from workers import runtime

REPO = Path(__file__).resolve().parents[2]


def run_python(code: str, tmp_path: Path) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("INVESTIGATE_")}
    env["INVESTIGATE_HOME"] = str(tmp_path / "home")
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.fixture
def restore_threshold() -> object:
    before = gc.get_threshold()
    yield before
    gc.set_threshold(*before)


def test_tune_collector_raises_only_the_first_generation(restore_threshold: object) -> None:
    gc.set_threshold(700, 13, 17)
    runtime.tune_collector()
    assert gc.get_threshold() == (runtime.GC_GEN0_THRESHOLD, 13, 17)
    gc.set_threshold(50_000, 10, 10)  # an operator's higher threshold is kept
    runtime.tune_collector()
    assert gc.get_threshold() == (50_000, 10, 10)
    gc.set_threshold(0, 10, 10)  # a disabled collector stays disabled
    runtime.tune_collector()
    assert gc.get_threshold() == (0, 10, 10)


def expected(default: tuple[int, int, int]) -> tuple[int, int, int]:
    """What :func:`runtime.tune_collector` makes of an interpreter's default threshold."""
    gen0, gen1, gen2 = default
    return (max(gen0, runtime.GC_GEN0_THRESHOLD) if gen0 else 0, gen1, gen2)


def test_a_workers_pool_children_inherit_the_threshold(tmp_path: Path) -> None:
    out = run_python("""
        import gc, os
        from workers.runtime import preload
        default = gc.get_threshold()
        preload()
        read, write = os.pipe()
        pid = os.fork()  # what the prefork pool does after worker_init
        if pid == 0:
            os.write(write, repr(gc.get_threshold()).encode())
            os._exit(0)
        os.waitpid(pid, 0)
        print(repr(default), os.read(read, 100).decode(), sep="|")
    """, tmp_path)
    default, child = (ast.literal_eval(part) for part in out.split("|"))
    assert child == expected(default) and child[0] >= runtime.GC_GEN0_THRESHOLD


def test_the_embedded_runtime_tunes_its_process(tmp_path: Path) -> None:
    out = run_python("""
        import gc
        from workers import runtime
        from workers.settings import load_settings
        default = gc.get_threshold()
        rt = runtime.embedded(load_settings())
        print(repr(default), repr(gc.get_threshold()), sep="|")
        rt.env.store.dispose()
    """, tmp_path)
    default, tuned = (ast.literal_eval(part) for part in out.split("|"))
    assert tuned == expected(default) and tuned[0] >= runtime.GC_GEN0_THRESHOLD


def test_the_langgraph_reference_runs_with_the_same_threshold() -> None:
    text = (REPO / "bench" / "langgraph_step.py").read_text()
    found = re.search(r"^GC_GEN0_THRESHOLD = ([\d_]+)$", text, re.M)
    assert found is not None
    assert int(found.group(1)) == runtime.GC_GEN0_THRESHOLD
