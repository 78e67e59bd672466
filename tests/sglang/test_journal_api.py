"""A program that keeps its run with the API (`keep=RunDir(out)`) over the suite's real SGLang server, killed with
-9 while its journal grows, then resumed by a fresh program (`RunDir(out).resume(engine)`): tests/kill_api.py."""

from __future__ import annotations

import pytest

from tests.kill_api import kill_and_resume
from tests.sglang.test_real_sglang import NOISE

pytestmark = pytest.mark.sglang


def test_a_program_killed_with_9_resumes_from_its_run_dir_as_if_never_killed(sglang, tmp_path):
    # one row x 2 samples: SGLang's CPU engine decodes the tiny model several times slower than vLLM's
    got = kill_and_resume(tmp_path, sglang.url, 0.6, NOISE, rows=1)
    print(got)  # the numbers docs/running.md quotes
    assert got["model_turns_in_flight"] <= got["redone"] <= got["in_flight"]
