"""`agentfsm replay` and `agentfsm show --journal` of tree runs (fsm/cli/replay.py): every node rebuilt in its
place from a real run's journal, checked with its own spec's codec and scored as the run scored it (a child by
its tree's reward, a forked root by its branches' mean), so a faithful run shows no difference."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.test_run_interrupts import REPO
from tests.test_tree_forks import agentfsm, run

SPECS = REPO / "specs"


@pytest.mark.slow
@pytest.mark.parametrize(
    "spec, place", [("planner_solver", "child calculator"), ("fork_calculator", "branch")]
)
def test_replay_of_a_tree_shows_each_node_as_the_run_made_it(tmp_path, spec, place):
    out = tmp_path / "run"
    done = run(SPECS / f"{spec}.yaml", out)
    assert done.returncode == 0, done.stderr[-3000:]
    with ThreadPoolExecutor() as both:  # two readers of the finished run, side by side
        replay, show = both.map(
            lambda argv: agentfsm(*argv),
            [("replay", str(out), "--row", "0"), ("show", str(out), "--journal")],
        )
    text = replay.stdout + replay.stderr
    assert replay.returncode == 0 and "Traceback" not in text, text[-3000:]
    headers = re.findall(r"^== row 0 sample 0 node (\S+) \((\w+[^,]*),", text, re.M)
    assert headers[0] == ("0", "root") and any(kind == place for _, kind in headers[1:]), headers
    rewards = re.findall(r"^reward: .*$", text, re.M)
    assert len(rewards) == len(headers), text[-3000:]
    assert all(line.endswith("(difference +0)") for line in rewards), rewards  # none false, none missing
    assert text.count("token check: exact") == len(headers), text[-3000:]
    assert show.returncode == 0 and "Traceback" not in show.stderr, show.stderr[-3000:]
    assert re.search(r"^tree \S+: \d+ nodes$", show.stdout, re.M), show.stdout[:2000]
