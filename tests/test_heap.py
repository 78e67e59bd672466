"""fsm/run/heap.py: an engine whose run puts FREEZE_AT trajectories in flight freezes the heap (after a full
collection), the last close unfreezes it, a process that froze its heap itself keeps it as it was, and
`freeze_heap=False` leaves it alone."""

from __future__ import annotations

import gc
import weakref

import pytest

from backends.scripted import echo_backend
from fsm import RolloutEngine
from fsm.run import heap
from specs.calculator import make_prompts


@pytest.fixture(autouse=True)
def thawed(monkeypatch):
    monkeypatch.setattr(heap, "FREEZE_AT", 2)  # a run of two rows is one that freezes
    gc.unfreeze()
    yield
    gc.unfreeze()


def engine(tok, **options) -> RolloutEngine:
    return RolloutEngine("calculator", tok, backend=echo_backend(), **options)


def test_engines_share_one_freeze_until_the_last_closes(tok):
    first, second = engine(tok), engine(tok)
    before = gc.get_threshold()
    try:
        assert len(first.generate_sequences(make_prompts(2))) == 2
        frozen = gc.get_freeze_count()  # objects in the permanent generation (each freed one leaves it)
        assert frozen > 10_000
        assert gc.get_threshold() == heap.RUN_THRESHOLD  # young objects collected less often while frozen
        second.generate_sequences(make_prompts(2))  # shares the freeze: nothing more is frozen
        assert gc.get_freeze_count() <= frozen
        first.close()
        assert gc.get_freeze_count() > frozen - 1_000  # the second still runs
    finally:
        first.close()
        second.close()
    assert gc.get_freeze_count() == 0
    assert gc.get_threshold() == before
    first.close()  # a second close releases nothing twice
    assert gc.get_freeze_count() == 0


def test_garbage_is_collected_before_the_freeze(tok):
    class Node:
        other: Node

    gc.disable()  # the cycle stays until the engine's own collection
    try:
        a, b = Node(), Node()
        a.other, b.other = b, a  # a cycle only the collector frees
        alive = weakref.ref(a)
        del a, b
        assert alive() is not None
        e = engine(tok)
        try:
            e.generate_sequences(make_prompts(2))
            assert alive() is None  # collected, not frozen
        finally:
            e.close()
    finally:
        gc.enable()


def test_a_process_that_froze_its_heap_keeps_it_and_an_opted_out_engine_freezes_nothing(tok):
    gc.freeze()
    e = engine(tok)
    try:
        e.generate_sequences(make_prompts(2))
    finally:
        e.close()
    assert gc.get_freeze_count() > 10_000  # the process's own freeze: not undone by the engine
    assert gc.get_threshold() != heap.RUN_THRESHOLD  # nor its collector's settings changed
    gc.unfreeze()
    off = engine(tok, freeze_heap=False)
    try:
        off.generate_sequences(make_prompts(2))
        assert gc.get_freeze_count() == 0
    finally:
        off.close()
    held = heap.hold()  # the module's count is back at zero: this hold freezes
    assert held is not None and gc.get_freeze_count() > 0
    held.release()
    assert gc.get_freeze_count() == 0


def test_only_a_run_of_freeze_at_trajectories_freezes(tok, monkeypatch):
    monkeypatch.setattr(heap, "FREEZE_AT", 8)
    e = engine(tok)
    try:
        e.generate_sequences(make_prompts(3), n=2)  # 6 in flight
        assert gc.get_freeze_count() == 0
        e.generate_sequences(make_prompts(4), n=2)
        assert gc.get_freeze_count() > 0
    finally:
        e.close()
    assert gc.get_freeze_count() == 0


async def test_a_ray_actor_freezes_its_process_heap_for_a_large_chunk_and_releases_it_at_close(tok):
    """fsm/adapters/ray_runner.py `_Worker`, the actor's class, driven without Ray."""
    from fsm.adapters.ray_runner import _Worker
    from fsm.run.context import Sampling

    worker = _Worker("calculator", tok, None, echo_backend, 0, 64)
    sampling = Sampling.resolve(worker.runner.agent, worker.runner.codec)
    try:
        trajs, _ = await worker.run("k", sampling, make_prompts(1), [0], 1)
        assert len(trajs) == 1 and gc.get_freeze_count() == 0  # one row: under FREEZE_AT (2 here)
        trajs, _ = await worker.run("k", sampling, make_prompts(2), [1, 2], 1)
        assert len(trajs) == 2 and gc.get_freeze_count() > 0
    finally:
        await worker.close()
    assert gc.get_freeze_count() == 0


def test_the_cli_leaves_the_freeze_to_its_engine(monkeypatch, tmp_path):
    """`agentfsm run` and `agentfsm bench` once froze the process's heap themselves, which made the engine's own
    freeze (this module) see a frozen process and skip, leaving what loaded after the CLI's freeze (transformers,
    the model) in the collector's view: now the engine's hold is the one mechanism, released at its close."""
    from fsm.cli.commands import main
    from tests.test_cli import _ThreadServer, run_argv

    holds = []
    real_hold = heap.hold

    def hold():
        holds.append(gc.get_freeze_count())  # what the process had frozen before the engine's hold
        return real_hold()

    monkeypatch.setattr(heap, "hold", hold)
    server = _ThreadServer(echo_backend())
    try:
        assert main(run_argv(server.url, tmp_path / "out", "--num-prompts", "2", "-q")) == 0
    finally:
        server.close()
    assert holds == [0]  # the engine froze a heap nobody had frozen
    assert gc.get_freeze_count() == 0  # and its close unfroze it


def test_a_batch_of_tool_calls_leaves_no_cycles_for_the_collector(tok):
    """While frozen, the young generation is collected at RUN_THRESHOLD: what a batch leaves in reference cycles
    waits for a collection that walks everything young. A tool call under a timeout (fsm/tools/base.py
    StartTimeout) once left its task, coroutine, timer and context in one cycle per call (~20 objects a row);
    now a batch leaves only the run's own few."""
    from backends.scripted import calculator_backend
    from backends.tiny import ASSET_DIR

    rows = make_prompts(20, seed=1)
    with RolloutEngine("calculator", tok, backend=calculator_backend(str(ASSET_DIR))) as runner:
        runner.generate_sequences(rows)  # the engine's setup is not the batch's
        gc.collect()
        gc.set_debug(gc.DEBUG_SAVEALL)  # what the collector would free is kept in gc.garbage, to be named
        try:
            out = runner.generate_sequences(rows)
            gc.collect()
            kinds = sorted({type(o).__qualname__ for o in gc.garbage})
            garbage = len(gc.garbage)
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
    assert [m["num_tool_calls"] for m in out.meta_info["metrics"]] == [1] * len(rows)  # each called the tool
    assert "StartTimeout" not in kinds and "Task" not in kinds, kinds
    assert garbage < len(rows), (garbage, kinds)
