"""RayRunner with `journal_dir` (fsm/adapters/ray_journal.py) on a local CPU Ray instance: an actor killed while
it holds trajectories between model turns, the run goes on, and those trajectories continue from their last
journaled state boundary on the other actor: no row twice, the turns they had finished are not asked for
again (every answer the model gives is logged and counted), and the batch equals the uninterrupted one's."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from pathlib import Path

import pytest

from tests.conftest import extra  # noqa: E402

ray = extra("ray", "ray")

from fsm import RayRunner  # noqa: E402
from fsm.run.fold import rebuild  # noqa: E402
from fsm.run.journal import JournalError, records  # noqa: E402
from specs.calculator import make_prompts  # noqa: E402
from tests.conftest import ASSETS  # noqa: E402
from tests.fixtures.turns import TURNS, LoggedTurns  # noqa: E402
from tests.test_ray import cluster, same_batch  # noqa: E402, F401  (cluster: the module's Ray fixture)

LATENCY_S = 0.3  # per model turn: a trajectory spends most of its time waiting on one, so a kill finds some
T0 = {"temperature": 0.0}


def turns_between(journal_dir: Path) -> tuple[int, dict[str, int]] | None:
    """(rank, {session: model turns journaled}) of a chunk journal holding a trajectory that has finished at
    least one model turn and not its last; None when none does yet."""
    for path in sorted(journal_dir.glob("*.log")):
        try:
            rebuilt = rebuild(records(path))
        except (JournalError, FileNotFoundError):  # removed as its chunk came back, or not whole yet
            continue
        held = {s: t.assistant_turns for s, t in rebuilt.trajs.items() if s not in rebuilt.done}
        if any(0 < k < TURNS for k in held.values()):
            return int(path.name.rsplit(".r", 1)[1].split(".")[0]), held
    return None


@pytest.mark.slow
async def test_a_killed_actors_trajectories_go_on_from_the_journal_elsewhere(cluster, tmp_path):
    log, journal_dir = tmp_path / "answers.log", tmp_path / "journal"
    rows = make_prompts(12)
    with RayRunner(
        "calculator",
        tokenizer=str(ASSETS),
        backend_factory=LoggedTurns(str(log), str(ASSETS), LATENCY_S),
        workers=2,
        max_concurrency=4,
        journal_dir=journal_dir,
    ) as runner:
        runner.ready()
        reference = await runner.agenerate_sequences(rows, T0, n=2)
        assert runner.stats["actor_deaths"] == 0 and runner.stats["journal_resumed"] == 0
        assert list(journal_dir.iterdir()) == []  # each chunk's journal went when the chunk came back
        assert sorted(Counter(log.read_text().split("\n")[:-1]).values()) == [1] * (24 * TURNS)
        log.unlink()

        task = asyncio.create_task(runner.agenerate_sequences(rows, T0, n=2))
        deadline = time.monotonic() + 240  # a bound, not a wait: a loaded 2-core machine is slow
        while (found := turns_between(journal_dir)) is None:
            assert time.monotonic() < deadline and not task.done(), "no trajectory between turns"
            await asyncio.sleep(0.01)
        rank, held = found
        ray.kill(runner.actors[rank])
        out = await asyncio.wait_for(task, 240)
        stats = runner.stats
    assert stats["actor_deaths"] == 1 and stats["journal_refused"] == 0
    assert stats["journal_resumed"] >= 1  # at least the one found between turns went on from its boundary
    same_batch(reference, out)  # every row once, in input order, as the uninterrupted run computed it
    answers = Counter(log.read_text().split("\n")[:-1])
    for session, k in held.items():  # what the journal held at the kill is never asked for again
        assert all(answers[f"{session} {j}"] == 1 for j in range(k)), (session, k)
    assert len(answers) == 24 * TURNS  # no trajectory started again under a new session
    redone = sum(answers.values()) - 24 * TURNS
    assert (
        redone <= 4
    )  # at most the turns in flight: one per trajectory the killed actor held (max_concurrency)
    assert list(journal_dir.iterdir()) == []


@pytest.mark.slow
def test_a_hung_actors_trajectories_go_on_from_the_journal_in_the_continuous_mode(cluster, tmp_path):
    """The first actor's server never answers: past hang_s the driver kills it, and its trajectories, journaled
    waiting on their first model turn, go on from that boundary on the other actor (submit / take)."""
    from tests.fixtures.hang import HangOnce

    rows = make_prompts(6)
    journal_dir = tmp_path / "journal"
    with RayRunner(
        "calculator",
        tokenizer=str(ASSETS),
        backend_factory=HangOnce(str(tmp_path / "hung")),
        workers=2,
        max_concurrency=2,
        hang_s=5.0,
        journal_dir=journal_dir,
    ) as runner:
        runner.submit(rows, n=2)
        batch = runner.take(6, timeout=240)
        stats = runner.stream_stats
    assert sorted(batch.non_tensor_batch["uid"]) == sorted(r["uid"] for r in rows for _ in range(2))
    assert all(r == "done" for r in batch.non_tensor_batch["termination_reason"])
    assert stats["hung_actors"] == 1 and stats["actor_deaths"] == 1
    assert stats["journal_resumed"] >= 1 and stats["journal_refused"] == 0
    assert list(journal_dir.iterdir()) == []


@pytest.mark.slow
def test_run_ray_journals_its_chunks_under_out_and_a_killed_actors_rows_go_on(
    cluster, tmp_path, monkeypatch, capsys
):
    """`agentfsm run --ray --out DIR` journals each chunk in flight under DIR/ray-journal (fsm/cli/ray_run.py):
    an actor killed while it holds begun trajectories, the run completes, those go on from the journal, every
    row once; what a killed --ray run left there is removed first, said in one line."""
    import json
    import threading

    from backends.scripted import scripted_servers
    from fsm.cli import ray_run
    from fsm.cli.commands import main

    out = tmp_path / "out"
    (out / ray_run.RAY_JOURNAL).mkdir(parents=True)
    (out / ray_run.RAY_JOURNAL / "dead0-0.a0.r0.log").write_text("left by a --ray run killed with -9\n")
    made: list[RayRunner] = []
    plain = ray_run.ray_runner
    monkeypatch.setattr(ray_run, "ray_runner", lambda *a: made.append(plain(*a)) or made[-1])
    killed: list[int] = []

    def kill_one_between_turns() -> None:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            found = None
            for path in sorted((out / ray_run.RAY_JOURNAL).glob("*.log")):
                try:
                    rebuilt = rebuild(records(path))
                except (JournalError, FileNotFoundError):  # removed as its chunk came back, or not whole yet
                    continue
                if any(s not in rebuilt.done and len(t.path_times) for s, t in rebuilt.trajs.items()):
                    found = int(path.name.rsplit(".r", 1)[1].split(".")[0])
                    break
            if found is not None and made and made[0].actors:
                ray.kill(made[0].actors[found])
                killed.append(found)
                return
            time.sleep(0.01)

    with scripted_servers(1, latency_s=LATENCY_S) as urls:
        killer = threading.Thread(target=kill_one_between_turns, daemon=True)
        killer.start()
        rc = main(
            ["run", "specs/calculator.yaml", "--server", urls[0], "--tokenizer", str(ASSETS), "--ray"]
            + [
                "--workers",
                "2",
                "--concurrency",
                "4",
                "--num-prompts",
                "12",
                "--n",
                "2",
                "-q",
                "--out",
                str(out),
            ]
        )
        killer.join(60)
    err = capsys.readouterr().err
    assert rc == 0, err
    assert "removing 1 chunk journal a killed --ray run left" in err
    assert killed, "no chunk journal held a begun trajectory"
    stats = made[0].stats
    assert stats["actor_deaths"] == 1 and stats["journal_refused"] == 0 and stats["journal_resumed"] >= 1
    rows = [json.loads(line) for line in (out / "trajectories.jsonl").open()]
    keys = [(r["index"], r["sample"]) for r in rows]
    assert len(keys) == len(set(keys)) == 24  # every row once
    assert list((out / ray_run.RAY_JOURNAL).iterdir()) == []  # each chunk's journal went when it came back
