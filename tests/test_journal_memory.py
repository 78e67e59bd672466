"""Resuming a big journal in little memory (issue 50: resuming a 502 MB tree journal took 4.9 GB against 1.9 GB to
write it). The snapshot form a journal's resume restores from holds the trajectories it read back, not a copy
(`decoded`): each token the 4 bytes of the array it was read into, a row shared by its samples and tree nodes and a
spec's tool schemas by all (as in the run that wrote it), the same trajectories as the snapshot form written as
JSON. `agentfsm run --resume` reads the journal once (tests/test_journal.py). The measurements on a 50 MB and a
500 MB journal are in docs/running.md."""

from __future__ import annotations

import asyncio
import json
from array import array
from typing import Any

from backends.scripted import ScriptedBackend
from fsm import RolloutEngine
from fsm.api import load_agent
from fsm.run.codec import decode_trajectory, encode_trajectory
from fsm.run.journal import JOURNAL, Recorder, Writer
from fsm.run.resume import identity, load
from specs.calculator import make_prompts
from tests.conftest import ASSETS, REPO
from tests.test_tree_journal import _echo

TOKEN_ARRAYS = ("prompt_ids", "response_ids", "response_mask", "response_logprobs", "_version_runs")


async def _journaled(spec: str, rows: list[dict[str, Any]], path: Any) -> None:
    """A tree run journaled as `agentfsm run` journals it: its rows are its files' (no `taken` records)."""
    async with RolloutEngine(
        spec, tokenizer=str(ASSETS), backend=ScriptedBackend(_echo, model_name="echo")
    ) as e:
        recorder = Recorder(Writer(path, "off"), takes=False)
        recorder.header(identity(e.agent, e.codec, run_id="t", groups=len(rows), rows_expected=len(rows)))
        await e.ajournal(recorder)
        await e.asubmit(rows, n=1, sampling=e.sampling({"temperature": 0.0}))
        await e.atake_groups(len(rows))
        recorder.writer.close()


def _entries(data: dict[str, Any]) -> list[dict[str, Any]]:
    """Every trajectory of a snapshot form, tree nodes included."""
    out = []
    for g in data["groups"]:
        for td in g["trajectories"]:
            out += [td, *td.get("nodes", [])]
    return out


def _plain(traj: Any) -> dict[str, Any]:
    x = encode_trajectory(traj)
    x.pop("path_times")  # this process's clock
    return x


def test_a_resumed_tree_journal_is_held_once_with_its_tokens_as_arrays(tmp_path):
    spec = str(REPO / "specs" / "fork_calculator.yaml")
    rows = make_prompts(2, 0)  # the calculator's rows, with the answers its reward scores against
    asyncio.run(_journaled(spec, rows, tmp_path / JOURNAL))
    loaded = load(tmp_path / JOURNAL, load_agent(spec))
    entries = _entries(loaded.data)
    assert (
        len(entries) == 2 * 5 and sum("nodes" in e for e in entries) == 2
    )  # two roots of four branches each
    decoded = [decode_trajectory(td) for td in entries]
    assert all(decode_trajectory(td) is t for td, t in zip(entries, decoded))  # restored as read, no copy
    for t in decoded:
        for name in TOKEN_ARRAYS:
            assert isinstance(getattr(t, name), array), (t.session_id, name)
    assert sum(len(t.response_ids) for t in decoded) > 0
    # one row object per row, shared by its tree's nodes, and one spec's tool schemas, as in the run that wrote it
    assert len({id(t.row) for t in decoded}) == 2 and len({id(t.tool_schemas) for t in decoded}) == 1
    assert loaded.top_id == max(max(t.prompt_ids) for t in decoded)  # what `with_codec` bounds
    # the same trajectories as the form a snapshot file holds (every array a JSON list)
    for t in decoded:
        written = json.loads(json.dumps(encode_trajectory(t)))
        assert _plain(t) == _plain(decode_trajectory(written))
