"""fsm/tools/isolation.py's hand-offs: callbacks from other threads reach the loop in order, a burst in one
wake-up; a `Hop` hands one call's result or exception back that way, and a call whose caller gave up before
it started never starts."""

from __future__ import annotations

import asyncio
import gc
import threading

import pytest

from fsm.tools.isolation import Hop, LoopLane, Mailbox, ThreadLane, mailbox


async def test_a_burst_runs_in_order_after_one_wake_up():
    loop = asyncio.get_running_loop()
    box = Mailbox(loop)
    wakes, seen = [], []
    real = loop.call_soon_threadsafe
    loop.call_soon_threadsafe = lambda *a, **k: (wakes.append(1), real(*a, **k))[
        1
    ]  # count the self-pipe writes
    try:
        posted = threading.Event()

        def burst() -> None:
            for i in range(200):
                box.post(seen.append, i)
            posted.set()

        threading.Thread(target=burst).start()
        assert posted.wait(30)  # the loop is held by this test the whole time: nothing has run yet
        assert seen == []
        for _ in range(100):
            if len(seen) == 200:
                break
            await asyncio.sleep(0.01)
    finally:
        del loop.call_soon_threadsafe
    assert seen == list(range(200)) and len(wakes) == 1


async def test_a_raising_callback_is_reported_and_the_rest_still_run():
    loop = asyncio.get_running_loop()
    reported, seen = [], []
    loop.set_exception_handler(lambda _loop, context: reported.append(context["exception"]))
    box = Mailbox(loop)
    box.post(seen.append, 1)
    box.post(lambda: 1 / 0)
    box.post(seen.append, 2)
    await asyncio.sleep(0.05)
    assert seen == [1, 2] and isinstance(reported[0], ZeroDivisionError)


def test_posting_to_a_closed_loop_raises_and_leaves_nothing_behind():
    loop = asyncio.new_event_loop()
    box = Mailbox(loop)
    loop.close()
    with pytest.raises(RuntimeError, match="closed"):
        box.post(print, "never")
    with pytest.raises(RuntimeError, match="closed"):  # not swallowed as "a wake-up is on its way"
        box.post(print, "never")


async def test_one_mailbox_per_loop():
    assert mailbox(asyncio.get_running_loop()) is mailbox(asyncio.get_running_loop())


async def test_a_hop_gives_the_result_or_the_exception_from_another_thread():
    loop = asyncio.get_running_loop()
    ok, bad = Hop(loop), Hop(loop)
    threading.Timer(0.01, ok.answer, ("answer",)).start()
    threading.Timer(0.01, bad.answer, (None, ValueError("no"))).start()
    assert await ok.waiter == "answer"
    with pytest.raises(ValueError, match="no"):
        await bad.waiter
    late = Hop(loop)
    late.waiter.cancel()  # the caller stopped waiting: a late answer is dropped
    late.answer(3)
    await asyncio.sleep(0.01)


@pytest.mark.parametrize("kind", ["thread", "loop"])
async def test_a_call_cancelled_before_it_starts_never_starts(kind):
    """A ThreadLane's one thread is busy, or a LoopLane's loop blocked, when the second call comes and is
    cancelled: once they are free, the first call finishes and the second never runs."""
    running, release, ran = threading.Event(), threading.Event(), []

    def first() -> str:
        running.set()
        release.wait(30)
        return "first"

    async def first_on_loop() -> str:
        return first()  # holds the tool's loop: the second call's start waits behind it

    async def second_on_loop(name: str) -> None:
        ran.append(name)

    lane = ThreadLane("t", workers=1) if kind == "thread" else LoopLane("t")
    try:
        one = asyncio.ensure_future(lane.call(first if kind == "thread" else first_on_loop))
        for _ in range(300):
            if running.is_set():
                break
            await asyncio.sleep(0.01)
        two = asyncio.ensure_future(lane.call(ran.append if kind == "thread" else second_on_loop, "second"))
        await asyncio.sleep(0.05)
        two.cancel()
        with pytest.raises(asyncio.CancelledError):
            await two
        release.set()
        assert await one == "first"
        await asyncio.sleep(0.05)
        assert ran == []
    finally:
        release.set()
        lane.close()


def test_an_answer_for_a_closed_loop_is_dropped_quietly(caplog):
    """The caller's loop closes while a call's Hop waits; the answer that comes after is dropped, nothing
    raised on the answering thread, nothing left pending for the garbage collector to report in a later test."""
    outcome: list = []

    def scenario() -> None:
        loop = asyncio.new_event_loop()
        hop = Hop(loop)
        loop.close()  # the caller's loop goes away under it

        def answer() -> None:
            try:
                hop.answer(1)
                outcome.append("returned")
            except BaseException as exc:  # noqa: BLE001 - the test reports whatever escaped
                outcome.append(exc)

        thread = threading.Thread(target=answer)
        thread.start()
        thread.join(30)
        outcome.append(hop.waiter.done())

    scenario()
    gc.collect()  # what the scenario left unreachable: a Task pending on a closed loop would log now
    assert outcome == ["returned", False]
    assert "exception calling callback" not in caplog.text  # concurrent.futures logs a raising callback
    assert "Task was destroyed but it is pending" not in caplog.text
