"""A signal once a kept run's rows have started stops them at their next state with the journal flushed
(fsm/output/keep.py arms the run's interrupts before the rows start). Armed only after `asubmit` returned,
a signal landing between the rows starting and the arming cancelled the whole run as if it had never begun
(`agentfsm run` said "interrupted before the rollout" while rows were at the server: tests/test_snapshot.py
saw it once under load)."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from backends.scripted import echo_backend
from fsm import RolloutEngine, RunDir, RunInterrupted
from fsm.run.journal import records
from fsm.spec.registry import resolve


def test_a_signal_while_the_rows_are_being_submitted_stops_them_and_keeps_the_journal(tok, tmp_path):
    engine = RolloutEngine("specs/calculator.yaml", tok, backend=echo_backend(latency_s=0.5))
    rows = resolve(engine.agent.spec.demo_data, engine.agent.spec.trust.allow_modules)(3, seed=0)
    submit = engine.asubmit

    async def submit_then_signal(*args, **kwargs):  # the rows run; the signal comes before asubmit returns
        await submit(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGINT)
        await asyncio.sleep(0.05)  # the caller's loop runs the handler here, the rows still in their turn

    engine.asubmit = submit_then_signal  # type: ignore[method-assign]
    out = tmp_path / "out"
    with engine, pytest.raises(RunInterrupted):
        engine.generate_sequences(rows, {"temperature": 0, "seed": 0}, n=2, keep=RunDir(out))
    kinds = [r["t"] for r in records(out / "journal.log").records]
    assert kinds[0] == "run" and kinds.count("group") == 3 and "end" not in kinds  # stopped, to resume
