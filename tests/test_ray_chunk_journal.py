"""A Ray chunk's journal (fsm/adapters/ray_journal.py) without Ray: a chunk stopped twice while its trajectories
sit between model turns goes on from its journal each time, in the actor's own code path (`run_chunk` under an
Owner), and ends as the uninterrupted chunk does, with no model turn asked for twice and no file left behind."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from fsm.adapters.ray_journal import chunk_files, run_chunk
from fsm.api import load_agent, load_tokenizer
from fsm.run.journal import records
from fsm.run.resume import identity
from fsm.run.runtime import Owner, Runner
from fsm.run.trajectory import Trajectory
from specs.calculator import make_prompts
from tests.conftest import ASSETS
from tests.fixtures.turns import TURNS, LoggedTurns

N = 2


def logged_runner(log: Path) -> Runner:
    """The calculator on a model that logs each turn it answers to `log` (which turns ran, and how often)."""
    return Runner(
        load_agent("calculator"),
        LoggedTurns(str(log), str(ASSETS), 0.0)(),
        load_tokenizer(str(ASSETS)),
        max_concurrency=8,
    )


async def attempt(
    runner: Runner,
    root: Path,
    key: str,
    k: int,
    park: Callable[[Trajectory], bool] | None,
    accept: bool = False,
) -> tuple[list[Trajectory], dict[str, int]] | None:
    """Attempt `k` of chunk `key`-0 (2 rows x N): run to the end (None `park`), or until every trajectory is
    parked at a boundary where `park` holds or has finished, then cancelled there, as a killed actor stops.
    `accept`: the runner's `accept_changes`."""
    ident = identity(runner.agent, runner.codec)
    sampling = runner.make_context({"temperature": 0.0}).sampling
    fresh = runner.trajectories(make_prompts(2), N)
    waiting: set[str] = set()
    finished: set[str] = set()
    all_still = asyncio.Event()

    def check() -> None:
        if len(waiting) + len(finished) == len(fresh):
            all_still.set()

    async def tick(traj: Trajectory) -> None:
        if park is not None and park(traj):
            waiting.add(traj.session_id)
            check()
            await asyncio.Event().wait()  # parked: the boundary was journaled before this

    def done(traj: Trajectory) -> None:
        finished.add(traj.session_id)
        check()

    async with Owner(runner).serving() as owner:
        job = asyncio.create_task(
            run_chunk(
                owner,
                0,
                lambda: ident,
                tick,
                done,
                (key, 0, (str(root), k, "1s", accept)),
                sampling,
                N,
                fresh,
            )
        )
        if park is None:
            return await asyncio.wait_for(job, 60)
        await asyncio.wait_for(all_still.wait(), 60)
        job.cancel()
        await asyncio.gather(job, return_exceptions=True)
    return None


async def test_a_chunk_stopped_twice_between_turns_goes_on_from_its_journal(tmp_path):
    log = tmp_path / "answers.log"
    runner = logged_runner(log)
    whole = await attempt(runner, tmp_path, "whole", 0, None)
    assert whole is not None
    reference, counts = whole
    assert counts == {"resumed": 0, "restarted": 0, "recovered": 0, "refused": 0, "bytes": counts["bytes"]}
    log.unlink()

    await attempt(runner, tmp_path, "cut", 0, lambda t: t.assistant_turns >= 1)
    assert [a for a, _ in chunk_files(tmp_path, "cut", 0)] == [0]  # kept for the next attempt
    await attempt(runner, tmp_path, "cut", 1, lambda t: t.assistant_turns >= 2)
    assert [a for a, _ in chunk_files(tmp_path, "cut", 0)] == [1]  # attempt 0's went once 1's held it all
    last = await attempt(runner, tmp_path, "cut", 2, None)
    assert last is not None
    trajs, counts = last
    assert counts["resumed"] == 2 * N and counts["refused"] == counts["restarted"] == counts["recovered"] == 0
    assert chunk_files(tmp_path, "cut", 0) == []
    answers = Counter(log.read_text().split("\n")[:-1])
    assert sorted(answers.values()) == [1] * (2 * N * TURNS)  # every turn asked for once, over three attempts
    assert len({s.split()[0] for s in answers}) == 2 * N  # each trajectory kept its session throughout
    for a, b in zip(sorted(reference, key=lambda t: t.index), sorted(trajs, key=lambda t: t.index)):
        assert a.row is None and b.row is None
        assert (a.index, a.sample, a.uid) == (b.index, b.sample, b.uid)
        assert a.response_ids.tolist() == b.response_ids.tolist()
        assert a.response_mask.tolist() == b.response_mask.tolist()
        assert a.response_logprobs.tolist() == b.response_logprobs.tolist()
        assert a.path == b.path and a.termination_reason == b.termination_reason
        assert a.reward_score == b.reward_score and a.assistant_turns == TURNS


async def test_a_damaged_chunk_journal_is_refused_in_one_line_and_its_chunk_runs_from_the_start(
    tmp_path, caplog
):
    log = tmp_path / "answers.log"
    runner = logged_runner(log)
    await attempt(runner, tmp_path, "cut", 0, lambda t: t.assistant_turns >= 1)
    [(_, path)] = chunk_files(tmp_path, "cut", 0)
    lines = path.read_bytes().split(b"\n")
    lines[2] = lines[2].replace(b'"uid"', b'"uix"', 1)  # an edit: its checksum no longer matches
    path.write_bytes(b"\n".join(lines))
    last = await attempt(runner, tmp_path, "cut", 1, None)
    assert last is not None
    trajs, counts = last
    assert counts["refused"] == 1 and counts["resumed"] == counts["recovered"] == 0
    [said] = [r.getMessage() for r in caplog.records if r.name == "agentfsm.ray"]
    assert said == (
        f"agentfsm: {path}: record 3: its checksum does not match (damaged or edited); the run cannot be "
        "resumed from it; its chunk runs again from the start"
    )
    assert chunk_files(tmp_path, "cut", 0) == []
    assert all(t.assistant_turns == TURNS and t.error is None for t in trajs)
    answers = Counter(s.split()[1] for s in log.read_text().split("\n")[:-1])
    assert answers == {"0": 2 * 2 * N, "1": 2 * N, "2": 2 * N}  # the first turns twice: run from the start


async def test_a_chunk_resumed_after_weight_updates_goes_on_from_its_journal(tmp_path):
    """An actor's tokens carry the weight version it serves (its gate's, counted from the driver's updates). Each
    attempt's journal says which versions its tokens may carry (its `run` record's `weight_version`, a `weights`
    record for each older one a carried trajectory holds and for each new one served while it runs), so the next
    attempt reads it back; before, every such token read as a version never served, and the chunk ran again from
    the start (`refused`). Its rows go on with the weights their last tokens came from, as a resumed run's."""
    log = tmp_path / "answers.log"
    runner = logged_runner(log)

    def new_weights_then_park(t: Trajectory) -> bool:
        runner.gate.version = 5  # new weights while attempt 1 runs: its next turns carry them
        return t.assistant_turns >= 2

    runner.gate.version = 3
    await attempt(runner, tmp_path, "cut", 0, lambda t: t.assistant_turns >= 1)
    await attempt(runner, tmp_path, "cut", 1, new_weights_then_park)
    last = await attempt(runner, tmp_path, "cut", 2, None)
    assert last is not None
    trajs, counts = last
    assert counts["resumed"] == 2 * N and counts["refused"] == counts["restarted"] == 0
    assert {v for t in trajs for v in t.response_versions.tolist() if v >= 0} == {3, 5}
    assert sorted(Counter(log.read_text().split("\n")[:-1]).values()) == [1] * (2 * N * TURNS)


async def cut_under_old_weights(runner: Runner, tmp_path: Path) -> Path:
    """A chunk's first attempt cut after each row's first turn under weight version 3, then new weights (4)
    before the next attempt; the cut chunk's journal."""
    runner.gate.version = 3
    await attempt(runner, tmp_path, "cut", 0, lambda t: t.assistant_turns >= 1)
    [(_, path)] = chunk_files(tmp_path, "cut", 0)
    runner.gate.version = 4  # new weights between the attempts
    return path


async def test_a_chunk_resumed_under_newer_weights_is_refused_in_one_line_and_runs_from_the_start(
    tmp_path, caplog
):
    """The check a resumed run makes (fsm/run/resume.py `weights_change`): an update between the actor's death and
    the next attempt would have its rows go on with weights their last tokens did not come from. Before, the chunk
    went on (resumed 2 * N, its rows' tokens of versions 3 and 4)."""
    log = tmp_path / "answers.log"
    runner = logged_runner(log)
    path = await cut_under_old_weights(runner, tmp_path)
    last = await attempt(runner, tmp_path, "cut", 1, None)
    assert last is not None
    trajs, counts = last
    assert counts["refused"] == 1 and counts["resumed"] == counts["recovered"] == 0
    [said] = [r.getMessage() for r in caplog.records if r.name == "agentfsm.ray"]
    assert said == (
        f"agentfsm: {path}: {2 * N} unfinished trajectories were generated with weight version 3, but the engine's "
        f"model ({type(runner.backend).__name__}) now serves weight version 4; its chunk runs again from the start"
    )
    assert chunk_files(tmp_path, "cut", 0) == []
    assert {v for t in trajs for v in t.response_versions.tolist() if v >= 0} == {4}
    assert all(t.assistant_turns == TURNS and t.error is None for t in trajs)
    answers = Counter(s.split()[1] for s in log.read_text().split("\n")[:-1])
    assert answers == {"0": 2 * 2 * N, "1": 2 * N, "2": 2 * N}  # the first turns twice: run from the start


async def test_a_chunk_resumed_under_newer_weights_with_changes_accepted_goes_on_from_its_journal(
    tmp_path, caplog
):
    """`RayRunner(accept_changes=True)`, as `--resume --accept-changes`: the chunk goes on under the new weights
    instead of running from the start, says so in one line, records the change in its journal (a `resume`
    record), and its rows carry both weight versions, each turn asked for once."""
    log = tmp_path / "answers.log"
    runner = logged_runner(log)
    path = await cut_under_old_weights(runner, tmp_path)
    await attempt(runner, tmp_path, "cut", 1, lambda t: t.assistant_turns >= 2, accept=True)
    [said] = [r.getMessage() for r in caplog.records if r.name == "agentfsm.ray"]
    change = (
        f"{2 * N} unfinished trajectories were generated with weight version 3, but the engine's model "
        f"({type(runner.backend).__name__}) now serves weight version 4 (their next tokens carry version 4)"
    )
    assert said == f"agentfsm: {path}: going on with changes accepted (recorded in the journal): {change}"
    [(_, kept)] = chunk_files(tmp_path, "cut", 0)
    [resume] = [r for r in records(kept).records if r["t"] == "resume"]
    assert resume["accepted"] == [change]
    last = await attempt(runner, tmp_path, "cut", 2, None, accept=True)
    assert last is not None
    trajs, counts = last
    assert counts["resumed"] == 2 * N and counts["refused"] == counts["restarted"] == 0
    assert {v for t in trajs for v in t.response_versions.tolist() if v >= 0} == {3, 4}
    assert all(t.assistant_turns == TURNS and t.error is None for t in trajs)
    assert sorted(Counter(log.read_text().split("\n")[:-1]).values()) == [1] * (2 * N * TURNS)
