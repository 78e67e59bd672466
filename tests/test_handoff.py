"""fsm/tools/isolation.py's hand-offs: callbacks from other threads reach the loop in order, a burst in one
wake-up; `settled` is `asyncio.wrap_future` (result, exception, cancellation both ways) with its answer handed
back that way."""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import threading
from typing import Any

import pytest

from fsm.tools.isolation import Mailbox, mailbox, settled


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


async def test_settled_gives_the_result_or_the_exception_from_another_thread():
    ok, bad = concurrent.futures.Future(), concurrent.futures.Future()
    threading.Timer(0.01, ok.set_result, ("answer",)).start()
    threading.Timer(0.01, bad.set_exception, (ValueError("no"),)).start()
    assert await settled(ok) == "answer"
    with pytest.raises(ValueError, match="no"):
        await settled(bad)
    done = concurrent.futures.Future()
    done.set_result(3)  # already settled: its callback runs at once, on this thread
    assert await settled(done) == 3


async def test_cancellation_goes_both_ways():
    source = concurrent.futures.Future()
    task = asyncio.ensure_future(settled(source))
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert source.cancelled()  # a call that had not started never starts

    source = concurrent.futures.Future()
    threading.Timer(0.01, source.cancel).start()
    with pytest.raises(asyncio.CancelledError):
        await settled(source)


def test_an_answer_for_a_closed_loop_is_dropped_quietly(caplog):
    """The caller's loop closes while `settled` waits; the answer that comes after is dropped, nothing raised on
    the answering thread. `settled` is stepped by hand, not run as a Task: a Task left pending on a closed loop
    logs "Task was destroyed but it is pending" whenever the garbage collector reaches it, in a later test."""
    outcome: list = []

    def scenario() -> None:
        source = concurrent.futures.Future()
        loop = asyncio.new_event_loop()
        waiting = settled(source)

        async def start() -> Any:
            return waiting.send(None)  # `settled` runs up to its `await waiter`, and yields the waiter

        waiter = loop.run_until_complete(start())
        loop.close()  # ...and its loop goes away under it

        def answer() -> None:
            try:
                source.set_result(1)
                outcome.append("returned")
            except BaseException as exc:  # noqa: BLE001 - the test reports whatever escaped
                outcome.append(exc)

        thread = threading.Thread(target=answer)
        thread.start()
        thread.join(30)
        outcome.append(waiter.done())
        waiting.close()

    scenario()
    gc.collect()  # what the scenario left unreachable: a Task pending on a closed loop would log now
    assert outcome == ["returned", False]
    assert "exception calling callback" not in caplog.text  # concurrent.futures logs a raising callback
    assert "Task was destroyed but it is pending" not in caplog.text
