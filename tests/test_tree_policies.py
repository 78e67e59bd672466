"""Several policies in one tree, through `agentfsm run` (docs/trees.md): a policy with no backend of its own
generates on the run's backend (not on the root policy's server), and each `batch.<policy>.pt` says the sampling
its own rows were drawn with (a trainer recomputes logprobs from it)."""

from __future__ import annotations

import asyncio
import sys

import pytest

from backends.devserver import DevServer
from fsm.api import make_backend
from fsm.output.batch import load_batch
from tests.test_run_interrupts import ASSETS, ENV, REPO

SPECS = REPO / "specs"


async def agentfsm(*args: str, timeout: float = 600) -> tuple[int, str]:
    """`agentfsm ARGS` as a real process, awaited without blocking the loop (a server in this process answers
    it meanwhile): (exit code, stderr)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "fsm.cli.commands",
        *args,
        env=ENV,
        cwd=REPO,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        _, err = await asyncio.wait_for(proc.communicate(), timeout)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    return proc.returncode or 0, err.decode()


@pytest.mark.slow
async def test_a_policy_without_a_backend_runs_on_the_runs_own_and_each_batch_has_its_sampling(tmp_path):
    """The planner (root) has a server of its own, the solver none: the solver's turns stay on the run's
    embedded model, so the server sees only the roots' requests; batch.solver.pt carries the solver's 0.7."""
    served = make_backend()
    try:
        async with DevServer(served) as dev:
            spec = tmp_path / "served_planner.yaml"
            spec.write_text(
                f"name: served_planner\nextends: {SPECS}/planner_solver.yaml\npolicies:\n"
                f"  planner: {{servers: [{dev.url}]}}\n  solver: {{sampling: {{temperature: 0.7}}}}\n"
            )
            out = tmp_path / "run"
            code, err = await agentfsm(
                "run", str(spec), "--out", str(out), "--tokenizer", str(ASSETS), "--num-prompts", "2", "-q"
            )
            rids = [e["rid"] for e in dev.log]
    finally:
        await served.close()
    assert code == 0, err[-3000:]
    planner, solver = load_batch(out / "batch.planner.pt"), load_batch(out / "batch.solver.pt")
    assert len(solver) >= 1, "the planner delegated nothing"
    roots = set(planner.non_tensor_batch["tree"])
    assert rids and all(rid.split("_t")[0] in roots for rid in rids), rids  # no child's (`<root>:0.0`) turn
    assert planner.meta_info["sampling"]["temperature"] == 1.0
    assert solver.meta_info["sampling"]["temperature"] == 0.7
    assert solver.meta_info["sampling"]["logprob_temperature"] == 0.7
