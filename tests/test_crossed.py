"""bench/crossed.py's `path`, the issue 47 number it measures: the call path of a batch through
`generate_sequences` crosses at most five modules and never steps back up a stage."""

from __future__ import annotations

import pytest

from bench import crossed
from tests.test_architecture import STAGES


def test_the_measure_reads_the_stages_of_the_architecture_test():
    assert crossed.STAGES == STAGES


@pytest.mark.slow
def test_a_batch_goes_down_the_stages():
    """Followed across the engine's loop thread and its tasks: the loop thread and its hand-offs belong to the
    stage that hands it coroutines (fsm/run/local.py), and a sync form runs the output stage's own coroutine on a
    loop of the calling thread (fsm/output/engine.py `BaseEngine._run_sync`), never on the engine's."""
    [path] = crossed.batch_path()["paths"]
    assert not path["back_up"] and path["modules"] <= 5, path
