"""A program that keeps its run with the API (`keep=RunDir(out)`) over the suite's real vLLM server, killed with
-9 while its journal grows, then resumed by a fresh program (`RunDir(out).resume(engine)`): tests/kill_api.py."""

from __future__ import annotations

import pytest

from tests.kill_api import kill_and_resume
from tests.vllm.test_real_vllm import NOISE

pytestmark = pytest.mark.vllm


def test_a_program_killed_with_9_resumes_from_its_run_dir_as_if_never_killed(vllm, tmp_path):
    got = kill_and_resume(tmp_path, vllm.url, 0.5, NOISE)
    print(got)  # the numbers docs/running.md quotes
    assert got["model_turns_in_flight"] <= got["redone"] <= got["in_flight"]
