""".ci/extras_tests.py picks the test modules .ci/run runs again without the optional extras (the README's
`pip install -e ".[test]"` in a fresh virtualenv): the ones that import an extra, ask for one, or run a file that
needs one. A module it missed would fail only on a user's first run, as two gateway tests once did."""

from __future__ import annotations

import importlib.util

import pytest

from tests.conftest import REPO


def _selector():
    spec = importlib.util.spec_from_file_location("extras_tests", REPO / ".ci" / "extras_tests.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_extras_are_read_from_pyproject():
    modules = _selector().extra_modules()
    assert {
        "openai",
        "anthropic",
        "agents",
        "langgraph",
        "ray",
        "trl",
        "datasets",
        "sglang",
        "verl",
    } <= modules
    assert (
        not {"pytest", "pyarrow", "hypothesis"} & modules
    )  # the test extra's own: present in that virtualenv


@pytest.mark.slow
def test_it_picks_every_module_that_needs_an_extra_and_not_the_rest():
    chosen = {p.relative_to(REPO).as_posix() for p in _selector().selected()}
    assert {
        "tests/gateway/test_hostile.py",  # imports openai in a harness
        "tests/gateway/test_workers.py",  # runs examples/gateway/base.yaml, whose harness imports openai
        "tests/gateway/test_harnesses.py",  # extra(NEEDS[name], ...)
        "tests/test_readme.py",
        "tests/test_ray.py",
        "tests/test_trl.py",
        "tests/test_cli_explains.py",
    } <= chosen
    assert not {"tests/test_engine.py", "tests/test_api.py", "tests/test_pause.py"} & chosen
