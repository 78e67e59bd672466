"""docs/gateway.md cannot rot: its bash and python blocks run as written (on the embedded tiny model), in the
checkout, with `agentfsm` meaning this checkout's CLI; the conventions are tests/test_readme.py's."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import REPO
from tests.test_readme import parse

DOC = REPO / "docs" / "gateway.md"
BLOCKS = [b for b in parse(DOC) if b.lang in ("bash", "python") and not b.skip]


@pytest.mark.parametrize("block", BLOCKS, ids=[f"gateway.md:{b.line} {b.lang}" for b in BLOCKS])
def test_doc_block_runs(block, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    if block.lang == "python":
        cmd = [sys.executable, "-c", block.text]
    else:
        text = block.text.replace("agentfsm ", f"{sys.executable} -m fsm.cli ").replace("runs/", f"{tmp_path}/")
        cmd = ["bash", "-ec", text]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{DOC.name}:{block.line}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
