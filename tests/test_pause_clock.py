"""backends/pause_clock.py: deadlines served by one shared timer end each wait on time, in any order, on any loop."""

import asyncio
import time

from backends.pause_clock import PauseClock


async def _ends(clock: PauseClock, timeouts: list[float]) -> list[float]:
    """How long after the start each wait on a future that never completes ran (waits begun 10 ms apart)."""
    loop = asyncio.get_running_loop()
    start = loop.time()

    async def one(k: int, timeout_s: float) -> float:
        await asyncio.sleep(0.01 * k)
        assert not await clock.wait(loop.create_future(), timeout_s)
        return loop.time() - start - 0.01 * k

    return await asyncio.gather(*(one(k, t) for k, t in enumerate(timeouts)))


def test_each_deadline_ends_its_wait_in_order_out_of_order_and_on_a_new_loop():
    clock = PauseClock()
    # 1 s then 0.1 s: the second's deadline comes first (a timer of its own); 1.1 s waits behind the first
    took = asyncio.run(_ends(clock, [1.0, 0.1, 1.1, 0.2]))
    assert all(t - 0.005 <= took_s < t + 0.5 for t, took_s in zip([1.0, 0.1, 1.1, 0.2], took)), took
    assert not clock._due and not clock._wakes
    # a loop closed with a wait still on it (never cancelled): the next loop arms a timer of its own
    dead = asyncio.new_event_loop()
    left = dead.create_task(clock.wait(dead.create_future(), 0.05))
    dead.run_until_complete(asyncio.sleep(0.01))
    dead.close()
    assert clock._due and not left.done()
    took = asyncio.run(asyncio.wait_for(_ends(clock, [0.15]), 5))
    assert 0.145 <= took[0] < 0.65, took


async def test_a_finished_answer_ends_the_wait_and_leaves_no_deadline():
    clock, loop = PauseClock(), asyncio.get_running_loop()
    done = loop.create_future()
    loop.call_later(0.01, done.set_result, None)
    assert await clock.wait(done, 30.0)
    assert not clock._due and not clock._wakes


def test_a_wait_begun_while_expired_ones_are_still_waking_gets_its_deadline():
    """The shared timer woke every clock due and armed nothing more; a wait that starts before those clocks have
    left (its task was ready first, as a socket's answer makes it) must still end on time, not wait forever."""
    clock = PauseClock()

    async def main() -> float:
        loop = asyncio.get_running_loop()
        first = loop.create_task(clock.wait(loop.create_future(), 0.05))
        go = loop.create_future()

        async def second() -> float:
            await go
            start = loop.time()
            assert not await clock.wait(loop.create_future(), 0.05)
            return loop.time() - start

        later = loop.create_task(second())
        await asyncio.sleep(0)
        loop.call_later(0.04, go.set_result, None)  # due with the first's deadline in one turn of the loop
        time.sleep(0.1)  # the loop is late: both callbacks run in the same turn, `go` first
        await first
        return await asyncio.wait_for(later, 5)

    assert 0.045 <= asyncio.run(main()) < 1.0
