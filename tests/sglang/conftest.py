"""One real SGLang 0.5.23 server for the whole real-SGLang suite: CPU engine, tiny model, loopback.

The server runs in its own virtualenv (built by `.ci/sglang_env.sh`; $SGLANG_VENV moves it) through the
project's launcher (backends/launcher.py, `device="cpu"`), and is started once per session: its start is
most of the suite's time. Without that virtualenv every test here is skipped, saying how to build it.
Tests that change the server's state (pause, weights) put it back before they end.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import ASSETS, REPO

VENV = Path(os.environ.get("SGLANG_VENV") or REPO / ".venv-sglang")
PYTHON = VENV / "bin" / "python"
READY_S = 600.0  # start to /health 200 (imports dominate; slow on a loaded 2-core machine)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def need_venv() -> None:
    if not (PYTHON.exists() and (VENV / "cuda-stand-in" / "libcuda.so.1").exists()):
        pytest.skip(
            f"real-SGLang suite: no sglang virtualenv at {VENV}; build it with `bash .ci/sglang_env.sh` "
            "(or point $SGLANG_VENV at one)"
        )


class Served:
    """A launched server: its URL and its log."""

    def __init__(self, url: str, log: Path):
        self.url, self.log = url, log


def launcher(port: int, log_dir: Path):  # -> SGLangLauncher (imported late: skipped suites import nothing)
    from backends.launcher import SGLangLauncher

    return SGLangLauncher(
        str(ASSETS),
        base_port=port,
        device="cpu",
        python=str(PYTHON),
        log_dir=log_dir,
        startup_timeout_s=READY_S,
        extra_args=["--log-level", "warning"],
    )


# package: stopped when this directory's tests end, not at the end of the whole suite (an idle CPU engine still
# polls: vLLM's worker took 7 % of a core for the rest of the run)
@pytest.fixture(scope="package")
def sglang(tmp_path_factory) -> Iterator[Served]:
    need_venv()
    launcher_ = launcher(free_port(), tmp_path_factory.mktemp("sglang"))
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(launcher_.__aenter__())
        yield Served(launcher_.urls[0], launcher_.logs[0])
    finally:
        loop.run_until_complete(launcher_.stop())
        loop.close()


class Restartable(Served):
    """A second server, for the tests with two: one port, which a test may crash (`kill`: SIGKILL to the
    process group, as the OOM killer would) and start again (`restart`). Every start is waited for at most
    READY_S; the fixture stops every one it started, whatever the test did."""

    def __init__(self, log_dir: Path):
        self.port, self.log_dir = free_port(), log_dir
        self.launchers: list = []
        super().__init__(f"http://127.0.0.1:{self.port}", log_dir)

    async def restart(self) -> float:
        """Start it (again) on its port; returns the monotonic time its /health first answered 200."""
        started = launcher(self.port, self.log_dir / f"start{len(self.launchers)}")
        self.launchers.append(started)
        await started.__aenter__()
        self.log = started.logs[0]
        return time.monotonic()

    def kill(self) -> None:
        self.launchers[-1].kill(0)

    async def stop(self) -> None:
        for started in self.launchers:
            await started.stop()


@pytest.fixture(scope="module")
def second_sglang(tmp_path_factory, sglang) -> Iterator[Restartable]:
    """A second real server beside the session's (`sglang`, started first: two starts at once only slow
    each other down on a small machine), for the tests of one module."""
    server = Restartable(tmp_path_factory.mktemp("sglang2"))
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(server.restart())
        yield server
    finally:
        loop.run_until_complete(server.stop())
        loop.close()
