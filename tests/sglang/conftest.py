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
        pytest.skip(f"real-SGLang suite: no sglang virtualenv at {VENV}; build it with `bash .ci/sglang_env.sh` "
                    "(or point $SGLANG_VENV at one)")  # fmt: skip


class Served:
    """A launched server: its URL and its log."""

    def __init__(self, url: str, log: Path):
        self.url, self.log = url, log


@pytest.fixture(scope="session")
def sglang(tmp_path_factory) -> Iterator[Served]:
    need_venv()
    from backends.launcher import SGLangLauncher

    launcher = SGLangLauncher(str(ASSETS), base_port=free_port(), device="cpu", python=str(PYTHON),
                              log_dir=tmp_path_factory.mktemp("sglang"), startup_timeout_s=READY_S,
                              extra_args=["--log-level", "warning"])  # fmt: skip
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(launcher.__aenter__())
        yield Served(launcher.urls[0], launcher.logs[0])
    finally:
        loop.run_until_complete(launcher.stop())
        loop.close()
