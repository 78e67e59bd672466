"""Hostile tools: nothing a tool does may hang, stall, kill or poison a run.

Sync tools that hang (their own threads, written off at the timeout; exit and Ctrl-C do not wait for them;
the embedded model's decode is not slowed), async tools that hang or busy-loop (their own event loop),
BaseExceptions (that row alone ends as an error row), `isolation: process` (a timed-out worker is killed
and replaced) and a 50 MB answer. Every hostile tool is bounded: tests/fixtures/faulty.py.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import tracemalloc
import venv

import pytest

import fsm
from backends.base import GenerateRequest
from fsm.api import make_backend
from fsm.families.parsers import ToolCall
from fsm.tools.base import BaseTool, ToolResponse, truncate
from fsm.tools.isolation import (
    BLOCKING_AMONG,
    BLOCKING_STEP_S,
    BLOCKING_STRIKES,
    InlineLane,
    LoopLane,
    ThreadLane,
    ToolUnavailable,
)
from tests.conftest import ASSETS, REPO, model_turn, run_agent, scripted, tool_messages, tool_turn, user_row
from tests.fixtures import faulty

FAULTY = "tests.fixtures.faulty"


@pytest.fixture(autouse=True)
def release_hostile_tools():
    """Hung tools return and spinning ones stop when the test ends, so none outlives it by much."""
    faulty.RELEASE.clear()
    yield
    faulty.RELEASE.set()
    time.sleep(0.05)  # a spinning thread sees it at its next GIL turn


def spec(*tools: str, **limits: object) -> str:
    """A spec extending the shipped tool_agent with these tools (YAML entries) and limits."""
    lines = [
        "name: faults",
        "extends: {specs}/tool_agent.yaml",
        "limits:",
        "  prompt_length: 1024",
        "  response_length: 1024",
        *(f"  {k}: {v}" for k, v in limits.items()),
        "tools:",
        *tools,
    ]
    return "\n".join(lines) + "\n"


def tool(function: str, **options: object) -> str:
    return "\n".join([f"  - function: {FAULTY}:{function}", *(f"    {k}: {v}" for k, v in options.items())])


async def run(tok, agent, script: dict[int, list], *, rows: int | None = None, **kw):
    """Rows by index, each with its own scripted turns (a final "done" turn is added to each)."""
    backend = scripted({i: turns + [model_turn(tok, "done")] for i, turns in script.items()})
    return await run_agent(agent, backend, tok, [user_row() for _ in range(rows or len(script))], **kw)


def lane_of(agent, name: str):
    return agent.tools.by_name[name].lane


# --- sync tools that hang ---------------------------------------------------------------------------------


async def test_hung_sync_tool_times_out_and_other_rows_go_on(tok, compile_yaml):
    agent = compile_yaml(spec(tool("hang", timeout_s=0.2), tool("echo")))
    t0 = time.perf_counter()
    trajs = await run(
        tok,
        agent,
        {
            0: [tool_turn(tok, ("hang", {"text": "x"}))],
            1: [tool_turn(tok, ("echo", {"text": "fine"}))],
            2: [tool_turn(tok, ("echo", {"text": "also fine"}))],
        },
    )
    assert time.perf_counter() - t0 < 5
    assert tool_messages(trajs[0]) == ["Error: tool 'hang' timed out after 0.2s"]
    assert [tool_messages(t) for t in trajs[1:]] == [["fine"], ["also fine"]]
    assert all(t.termination_reason == "done" for t in trajs)
    lane = lane_of(agent, "hang")
    assert lane.stuck == 1 and lane.written_off == 1  # counted, and no longer a slot
    assert all(t.daemon for t in threading.enumerate() if t.name.startswith("agentfsm-tool"))


async def test_timed_out_call_frees_its_slot(tok, compile_yaml):
    """workers: 1 and the only thread stuck: the next call gets a replacement thread, not a queue."""
    agent = compile_yaml(spec(tool("nap", timeout_s=0.3, workers=1)))
    (traj,) = await run(
        tok, agent, {0: [tool_turn(tok, ("nap", {"seconds": 3})), tool_turn(tok, ("nap", {"seconds": 0}))]}
    )
    assert tool_messages(traj) == ["Error: tool 'nap' timed out after 0.3s", "rested"]
    assert lane_of(agent, "nap").written_off == 1


async def test_a_timeout_counts_from_when_a_thread_takes_the_call():
    """Calls queued behind busy threads are not timed out unrun: thousands of calls in flight wait for a few
    threads, and the wait is not the tool's; a call that runs past the timeout still times out."""
    from fsm.tools.base import StartTimeout

    async def timed(call, timeout_s):
        async with StartTimeout(timeout_s):
            return await call

    lane = ThreadLane("nap", workers=1)
    t0 = time.monotonic()
    calls = [timed(lane.call(faulty.nap, seconds=0.4), 1.0) for _ in range(4)]  # the last waits 1.2 s
    assert await asyncio.gather(*calls) == ["rested"] * 4
    assert time.monotonic() - t0 >= 1.6
    with pytest.raises(TimeoutError):
        await timed(lane.call(faulty.hang, text="x"), 0.2)
    assert lane.written_off == 1
    with pytest.raises(TimeoutError):  # a coroutine (no lane queue) is timed from the start
        await timed(asyncio.sleep(5), 0.1)
    lane.close()


async def test_thread_lane_accounting_and_its_cap():
    lane = ThreadLane("hang", workers=1, max_stuck=2)
    for _ in range(2):
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.1):
                await lane.call(faulty.hang, text="x")
    assert (lane.stuck, lane.written_off) == (2, 2)
    with pytest.raises(ToolUnavailable, match="2 calls still running past their timeout"):
        await lane.call(faulty.echo, text="refused")
    faulty.RELEASE.set()  # the stuck calls return: their threads leave, the lane serves again
    for _ in range(100):
        if lane.stuck == 0:
            break
        await asyncio.sleep(0.01)
    assert lane.stuck == 0 and await lane.call(faulty.echo, text="back") == "back"
    lane.close()


@pytest.mark.slow
def test_exit_and_ctrl_c_do_not_wait_for_hung_tool_threads(tmp_path):
    """In a fresh interpreter: a run whose tool hangs finishes; then a run hung in a tool without a timeout
    gets Ctrl-C. Neither the interrupt nor the exit waits for the stuck threads."""
    for name, options in (("timeout", "    timeout_s: 0.2\n"), ("forever", "")):
        (tmp_path / f"{name}.yaml").write_text(
            f"name: hung\nextends: {REPO / 'specs' / 'tool_agent.yaml'}\n"
            f"tools:\n  - function: {FAULTY}:hang\n{options}"
        )
    script = tmp_path / "hung.py"
    script.write_text(
        textwrap.dedent(f"""
        import asyncio, json, signal, threading, time
        signal.signal(signal.SIGINT, signal.default_int_handler)  # as from a shell, whatever the test process's
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {{signal.SIGINT}})  # state was at the fork
        from transformers import AutoTokenizer
        import fsm
        from tests.conftest import model_turn, scripted, tool_turn, user_row

        tok = AutoTokenizer.from_pretrained({str(ASSETS)!r})
        def run(name):
            agent = fsm.compile_spec({str(tmp_path)!r} + "/" + name + ".yaml")
            backend = scripted([tool_turn(tok, ("hang", {{"text": "x"}})), model_turn(tok, "done")])
            return asyncio.run(fsm.Runner(agent, backend, tok).run([user_row()] * 3))
        trajs = run("timeout")
        print("FINISHED", json.dumps([t.termination_reason for t in trajs]), flush=True)
        def watch():
            while sum(t.name == "agentfsm-tool-hang" for t in threading.enumerate()) < 6:
                time.sleep(0.01)
            print("HUNG", flush=True)
        threading.Thread(target=watch, daemon=True).start()
        try:
            run("forever")
        except KeyboardInterrupt:
            print("INTERRUPTED", flush=True)
    """)
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, str(script)], cwd=REPO, env=env, stdout=subprocess.PIPE, text=True
    )
    t0, watchdog = None, threading.Timer(120, proc.kill)  # a script that never ends fails, never hangs
    watchdog.start()
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line.strip())
            if line.startswith("HUNG"):
                t0 = time.monotonic()
                proc.send_signal(signal.SIGINT)
        proc.wait(timeout=120)
        assert lines[0] == 'FINISHED ["done", "done", "done"]', lines
        assert lines[-1] == "INTERRUPTED", lines
        assert t0 is not None and time.monotonic() - t0 < 10  # interrupt and exit, 6 threads stuck for good
    finally:
        watchdog.cancel()
        proc.kill()


@pytest.mark.slow
async def test_hung_sync_tool_does_not_slow_the_embedded_model(compile_yaml):
    """The tiny model's decode runs in the event loop's default executor. Twelve calls of a calculator that
    never answers (timeout 0.2 s) leave twelve threads stuck for good, more than that executor has; they
    are the tool's own, so generate takes as long as before, and a whole run still finishes."""
    from specs.calculator import make_prompts

    agent = compile_yaml(f"""
        name: hung_calculator
        extends: {{specs}}/calculator.yaml
        limits:
          action_timeout_s: 60      # were decode starved, the test would fail here instead of hanging
        tools:
          - function: {FAULTY}:hung_calculator
            name: calculator
            schema: specs.calculator:TOOL_SCHEMA
            timeout_s: 0.2
    """)
    rows = make_prompts(8, seed=0)
    # The probe's model runs on this test's loop (an engine runs its backend on a loop of its own), so its
    # decode uses this loop's default executor: the one the stuck tool threads would have starved.
    async with fsm.RolloutEngine(agent) as engine, make_backend() as probe:
        prompt = engine.codec.encode_prompt(rows[0]["raw_prompt"], agent.tools.schemas)

        async def mean_generate_s(n: int = 5) -> float:
            t0 = time.perf_counter()
            for k in range(n):
                await probe.generate(
                    GenerateRequest(
                        f"probe-{k}", prompt, {"temperature": 0.0, "max_new_tokens": 24}, return_logprob=False
                    )
                )
            return (time.perf_counter() - t0) / n

        await mean_generate_s(1)  # warm-up
        before = await mean_generate_s()
        call = ToolCall("calculator", {"expression": "1+1"}, "")
        outcomes = await asyncio.gather(*(agent.tools.call(call, f"i{k}", {}, None) for k in range(12)))
        assert {o.error for o in outcomes} == {"timeout"}
        assert lane_of(agent, "calculator").stuck == 12 > concurrent.futures.ThreadPoolExecutor()._max_workers
        during = await asyncio.wait_for(mean_generate_s(), 60)  # starved decode fails, never hangs
        trajs = await engine.arun(rows, validate=True)
    print(f"mean generate: {before * 1e3:.0f} ms before, {during * 1e3:.0f} ms with 12 tool threads stuck")
    assert during < 2 * before + 0.05
    assert not any(t.failed for t in trajs) and sum(t.metrics.tool_errors for t in trajs) >= 4


# --- async tools that hang or spin ------------------------------------------------------------------------


async def test_async_tool_that_awaits_forever_times_out(tok, compile_yaml):
    agent = compile_yaml(spec(tool("ahang", timeout_s=0.2)))
    (traj,) = await run(tok, agent, {0: [tool_turn(tok, ("ahang", {"text": "x"}))]})
    assert tool_messages(traj) == ["Error: tool 'ahang' timed out after 0.2s"]
    assert traj.termination_reason == "done"


async def test_async_busy_loop_is_contained(tok, compile_yaml):
    """aspin never awaits (it spins until released, up to 10 s). On the main loop it would stall every
    trajectory and finish "successfully"; on its own loop it blocks only that thread and times out."""
    agent = compile_yaml(spec(tool("aspin", timeout_s=1.0), tool("atick")))
    ticks = [tool_turn(tok, ("atick", {"text": f"tick {k}"})) for k in range(5)]
    finished: dict[int, float] = {}
    t0 = time.perf_counter()
    trajs = await run(
        tok,
        agent,
        {0: [tool_turn(tok, ("aspin", {"text": "x"}))], 1: ticks},
        on_done=lambda t: finished.setdefault(t.index, time.perf_counter() - t0),
    )
    assert tool_messages(trajs[0]) == ["Error: tool 'aspin' timed out after 1s"]
    assert tool_messages(trajs[1]) == [f"tick {k}" for k in range(5)]
    assert finished[1] < finished[0] and finished[1] < 1.0  # row 1 went on while aspin spun
    assert finished[0] < 5  # the spin itself goes on until released (10 s at most)
    assert all(t.termination_reason == "done" for t in trajs)


async def test_wedged_tool_loop_is_replaced():
    lane = LoopLane("aspin", grace_s=0.05)
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.2):
            await lane.call(faulty.aspin, "x")
    await asyncio.sleep(0.1)  # the loop never ran the cancellation: wedged
    assert await lane.call(faulty.atick, "after") == "after"  # on a fresh loop
    assert lane.written_off == 1
    lane.close()


# --- isolation: none: coroutines on the run's own loop ---------------------------------------------------


async def test_isolation_none_runs_on_the_runs_loop_and_times_out(tok, compile_yaml):
    agent = compile_yaml(
        spec(tool("athread", isolation="none"), tool("ahang", isolation="none", timeout_s=0.2))
    )
    assert isinstance(lane_of(agent, "athread"), InlineLane)
    trajs = await run(
        tok,
        agent,
        {0: [tool_turn(tok, ("athread", {"text": "x"}))], 1: [tool_turn(tok, ("ahang", {"text": "x"}))]},
    )
    assert tool_messages(trajs[0]) == [threading.current_thread().name]  # no hand-off to another thread
    assert tool_messages(trajs[1]) == ["Error: tool 'ahang' timed out after 0.2s"]
    assert [t.termination_reason for t in trajs] == ["done", "done"]


async def test_isolation_none_tool_that_blocks_the_loop_moves_to_its_own(tok, compile_yaml, caplog):
    """Steps past BLOCKING_STEP_S (the sync sleep between two awaits), BLOCKING_STRIKES of them, move the
    tool: later calls run on a loop thread of its own, so the run's loop is not blocked by it again."""
    agent = compile_yaml(spec(tool("ablock", isolation="none", timeout_s=5), max_assistant_turns=9))
    lane = lane_of(agent, "ablock")
    turns = [
        tool_turn(tok, ("ablock", {"seconds": BLOCKING_STEP_S * 2})) for _ in range(BLOCKING_STRIKES + 1)
    ]
    (traj,) = await run(tok, agent, {0: turns})
    *first, last = tool_messages(traj)
    assert (
        first == [threading.current_thread().name] * BLOCKING_STRIKES and last == "agentfsm-tool-loop-ablock"
    )
    assert isinstance(lane.moved, LoopLane)
    assert f"'ablock' (isolation: none) held the event loop {BLOCKING_STRIKES} times" in caplog.text
    lane.close()


async def test_an_inline_tool_that_stalls_now_and_then_stays_on_the_loop():
    """A busy machine makes a well-behaved tool's step wait now and then (for the GIL, held by a thread the OS put
    off): stalls further apart than BLOCKING_AMONG steps never add up to a move; BLOCKING_STRIKES close together
    do (code that blocks stalls on most of its steps)."""
    lane = InlineLane("now_and_then")

    async def step(stall: bool) -> None:
        if stall:
            time.sleep(BLOCKING_STEP_S * 1.2)  # a voluntary switch past the limit: a stall

    for k in range(BLOCKING_STRIKES * BLOCKING_AMONG):
        await lane.call(step, k % BLOCKING_AMONG == 0)
    assert lane.moved is None and len(lane.stalls) == 1
    for _ in range(BLOCKING_STRIKES):
        await lane.call(step, True)
    assert isinstance(lane.moved, LoopLane)
    lane.close()


_OFF_THE_CORE = """
import asyncio, os, subprocess, sys, time
from fsm.tools.isolation import BLOCKING_STEP_S, InlineLane

cpu = min(os.sched_getaffinity(0))
os.sched_setaffinity(0, {cpu})
hog = subprocess.Popen([sys.executable, "-c", f"import os\\nos.sched_setaffinity(0, {{{cpu}}})\\nwhile 1: pass"])
os.nice(19)  # this process waits for the core while the hog (nice 0) runs on it


async def spin(seconds):
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


async def main():
    lane = InlineLane("spin")
    walls = []
    try:
        time.sleep(0.2)  # the hog has the core
        for _ in range(3):  # CPU well under BLOCKING_STEP_S a step, its wall past it
            t0 = time.perf_counter()
            await lane.call(spin, BLOCKING_STEP_S / 10)
            walls.append(time.perf_counter() - t0)
    finally:
        hog.kill()
        hog.wait()
    waited = len(lane.stalls)
    await lane.call(spin, BLOCKING_STEP_S * 1.5)  # a step that runs past the limit on the core is one
    print(min(walls) >= BLOCKING_STEP_S, waited, len(lane.stalls), lane.moved is None)


asyncio.run(main())
"""


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs CPU affinity (Linux)")
def test_an_inline_step_the_os_kept_off_the_core_is_no_stall():
    """A busy machine keeps a step of a well-behaved `isolation: none` tool waiting for a core: that step did not
    hold the loop (no sleep, no CPU past BLOCKING_STEP_S), so it is no strike against the tool (before, three of
    them moved it to a loop thread with a warning to change its spec). A step that spins past the limit is one."""
    out = subprocess.run(
        [sys.executable, "-c", _OFF_THE_CORE], capture_output=True, text=True, timeout=120, cwd=REPO
    )
    assert out.returncode == 0, out.stderr
    held_long, waited, stalls, stayed = out.stdout.split()
    if held_long != "True":
        pytest.skip("the OS ran this step without waiting past BLOCKING_STEP_S")
    assert (waited, stalls, stayed) == ("0", "1", "True")


async def test_isolation_none_base_exception_ends_that_row_only(tok, compile_yaml):
    agent = compile_yaml(spec(tool("araise_base", isolation="none", timeout_s=5), tool("echo")))
    trajs = await run(
        tok,
        agent,
        {
            0: [tool_turn(tok, ("araise_base", {"kind": "SystemExit"}))],
            1: [tool_turn(tok, ("echo", {"text": "fine"}))],
        },
    )
    assert "tool 'araise_base' raised SystemExit" in trajs[0].termination_reason
    assert trajs[1].termination_reason == "done" and tool_messages(trajs[1]) == ["fine"]


class InlineTool(BaseTool):
    """A class tool with isolation: none: its lifecycle runs on the run's loop; it records the calls."""

    calls: list[tuple[str, str]] = []

    async def create(self, instance_id=None, **kwargs):
        self.calls.append(("create", threading.current_thread().name))
        return instance_id, None

    async def execute(self, instance_id, parameters, **kwargs):
        self.calls.append(("execute", threading.current_thread().name))
        return ToolResponse(text="made"), 0.5, {}

    async def release(self, instance_id, **kwargs):
        self.calls.append(("release", threading.current_thread().name))


class SyncReleaseTool(InlineTool):
    def release(self, instance_id, **kwargs):  # not a coroutine: cannot run under isolation: none
        return None


INLINE_SCHEMA = {
    "type": "function",
    "function": {
        "name": "inline",
        "description": "Make.",
        "parameters": {"type": "object", "properties": {}},
    },
}


async def test_isolation_none_class_tool_runs_its_lifecycle_inline(tok, compile_yaml):
    InlineTool.calls.clear()
    entry = "  - class: tests.test_tool_faults:InlineTool\n    schema: tests.test_tool_faults:INLINE_SCHEMA\n    isolation: none"
    agent = compile_yaml(spec(entry))
    (traj,) = await run(tok, agent, {0: [tool_turn(tok, ("inline", {}))]})
    here = threading.current_thread().name
    assert InlineTool.calls == [
        ("create", here),
        ("execute", here),
        ("release", here),
    ]  # calc_reward: BaseTool's
    assert tool_messages(traj) == ["made"] and traj.tool_rewards == [0.5] and traj.tool_scores == [0.0]


def test_isolation_none_refuses_sync_code(compile_yaml):
    with pytest.raises(Exception, match="isolation: none runs coroutine functions only"):
        compile_yaml(spec(tool("echo", isolation="none")))
    entry = (
        "  - class: tests.test_tool_faults:SyncReleaseTool\n    schema: tests.test_tool_faults:INLINE_SCHEMA\n"
        "    isolation: none"
    )
    with pytest.raises(Exception, match=r"SyncReleaseTool'.release is not an async def"):
        compile_yaml(spec(entry))


# --- BaseExceptions ---------------------------------------------------------------------------------------


class ExitingTool(BaseTool):
    """A verl-style class tool whose execute raises SystemExit (its methods run on the tool's own loop)."""

    async def execute(self, instance_id: str, parameters: dict, **kwargs):
        raise SystemExit("class tool quits")


EXITING_SCHEMA = {
    "type": "function",
    "function": {
        "name": "exiting",
        "description": "Quit.",
        "parameters": {"type": "object", "properties": {}},
    },
}


@pytest.mark.parametrize("kind", ["SystemExit", "KeyboardInterrupt", "GeneratorExit", "CancelledError"])
@pytest.mark.parametrize("function", ["raise_base", "araise_base"])
async def test_base_exception_ends_that_row_only(tok, compile_yaml, function, kind):
    agent = compile_yaml(spec(tool(function, timeout_s=5), tool("echo")))
    trajs = await run(
        tok,
        agent,
        {
            0: [tool_turn(tok, (function, {"kind": kind}))],
            1: [tool_turn(tok, ("echo", {"text": "fine"}))],
            2: [tool_turn(tok, ("echo", {"text": "fine"}))],
        },
    )
    assert trajs[0].failed and trajs[0].termination_reason.startswith("error: ")  # finished, as an error row
    assert f"tool '{function}' raised {kind}" in trajs[0].termination_reason, trajs[0].termination_reason
    assert [t.termination_reason for t in trajs[1:]] == ["done", "done"]
    assert [tool_messages(t) for t in trajs[1:]] == [["fine"], ["fine"]]


async def test_class_tool_raising_system_exit_ends_that_row_only(tok, compile_yaml):
    exiting = (
        "  - class: tests.test_tool_faults:ExitingTool\n    schema: tests.test_tool_faults:EXITING_SCHEMA"
    )
    agent = compile_yaml(spec(exiting, tool("echo")))
    trajs = await run(
        tok, agent, {0: [tool_turn(tok, ("exiting", {}))], 1: [tool_turn(tok, ("echo", {"text": "ok"}))]}
    )
    assert "tool 'exiting' raised SystemExit: class tool quits" in trajs[0].termination_reason
    assert trajs[1].termination_reason == "done"


# --- isolation: process -----------------------------------------------------------------------------------


async def test_process_worker_past_its_timeout_is_killed_and_replaced(tok, compile_yaml):
    agent = compile_yaml(spec(tool("crunch", isolation="process", timeout_s=0.5, workers=1)))
    lane = lane_of(agent, "crunch")
    try:
        (traj,) = await run(
            tok,
            agent,
            {
                0: [
                    tool_turn(tok, ("crunch", {"seconds": -1})),  # spins forever
                    tool_turn(tok, ("crunch", {"seconds": 0})),
                ]
            },
        )
        first, second = tool_messages(traj)
        assert first == "Error: tool 'crunch' timed out after 0.5s"
        pid = int(second)
        assert pid != os.getpid() and os.kill(pid, 0) is None  # a live worker answered
        assert (lane.started, lane.killed) == (2, 1)
    finally:
        lane.close()


async def test_process_tool_crashes_end_that_row_only(tok, compile_yaml):
    agent = compile_yaml(spec(*(tool(name, isolation="process") for name in ("raise_base", "die", "echo"))))
    try:
        trajs = await run(
            tok,
            agent,
            {
                0: [tool_turn(tok, ("raise_base", {"kind": "SystemExit"}))],
                1: [tool_turn(tok, ("die", {"code": 7}))],
                2: [tool_turn(tok, ("echo", {"text": "fine"}))],
            },
        )
        assert "tool 'raise_base' raised SystemExit: 3" in trajs[0].termination_reason
        assert "tool 'die': its worker process died (exit code 7)" in trajs[1].termination_reason
        assert trajs[2].termination_reason == "done" and tool_messages(trajs[2]) == ["fine"]
    finally:
        agent.tools.close()


# --- a 50 MB answer ---------------------------------------------------------------------------------------

N = 50_000_000


@pytest.mark.parametrize("side", ["left", "right", "middle"])
async def test_50_mb_answer_is_truncated_without_holding_it(tok, compile_yaml, side):
    agent = compile_yaml(spec(tool("big"), max_tool_response_length=20, tool_response_truncate_side=side))
    tracemalloc.start()
    try:
        faulty.big(N)
        _, tool_peak = tracemalloc.get_traced_memory()  # what the tool itself needs to build its answer
        tracemalloc.reset_peak()
        base, _ = tracemalloc.get_traced_memory()
        (traj,) = await run(tok, agent, {0: [tool_turn(tok, ("big", {"n": N}))]})
        for _ in range(100):  # the tool's thread drops its last reference a moment after it answers
            after, peak = tracemalloc.get_traced_memory()
            if after - base < 4 << 20:
                break
            await asyncio.sleep(0.01)
    finally:
        tracemalloc.stop()
    assert tool_messages(traj) == [truncate("a" + "b" * 100 + "z", 20, side)]
    assert peak - base < tool_peak + (8 << 20)  # no copy of the 50 MB beyond the tool's own
    assert after - base < 4 << 20  # and nothing kept


async def test_50_mb_answer_from_a_worker_is_cut_before_it_crosses(tok, compile_yaml):
    agent = compile_yaml(spec(tool("big", isolation="process"), max_tool_response_length=20))
    try:
        await agent.tools.by_name["big"].lane.ready()  # the worker's start is not measured
        tracemalloc.start()
        try:
            (traj,) = await run(tok, agent, {0: [tool_turn(tok, ("big", {"n": N}))]})
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert tool_messages(traj) == [truncate("a" + "b" * 100 + "z", 20, "middle")]
        assert peak < 16 << 20  # the parent never saw the 50 MB
    finally:
        agent.tools.close()


def test_a_worker_imports_the_standard_library_and_fsm_tools_only():
    """A worker process imports fsm/tools/processes.py (and isolation.py): one of them importing the engine (a
    spec, pydantic, torch) would add seconds to every worker's start."""
    probe = "import sys, fsm.tools.processes; print(' '.join(sorted({m.split('.')[0] for m in sys.modules})))"
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120)
    loaded = set(out.stdout.split())
    assert "fsm" in loaded, out.stderr
    assert not loaded & {"backends", "pydantic", "torch", "numpy", "ruamel", "transformers", "yaml", "orjson"}


def test_a_worker_starts_after_its_parent_left_the_folder_it_imported_fsm_from(tmp_path):
    """A parent that imported fsm from its working directory ('' on sys.path) and moved away still starts
    workers: a worker also looks in the folder fsm came from (1f9d9aa). The interpreter is a bare virtualenv's,
    without agentfsm installed and without PYTHONPATH, so sys.path alone decides whether the worker finds fsm."""
    venv.create(tmp_path / "venv")  # no pip, nothing installed
    probe = (
        "import asyncio, os, fsm.tools.processes as p; "
        f"os.chdir({str(tmp_path)!r}); "
        "print(asyncio.run(p.ProcessLane('dumps', 'json:dumps', 1).call(None, obj=[1, 2])))"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run(
        [str(tmp_path / "venv" / "bin" / "python"), "-c", probe],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.stdout.strip() == "[1, 2]", out.stderr


@pytest.mark.slow
def test_ctrl_c_delivered_to_a_hung_tool_thread_wakes_the_loop(tmp_path):
    """The kernel hands a process's SIGINT to any of its threads. Sent to the thread of a hung tool, with the
    watchdog off (no timer due), the loop slept through it before: Python runs the handler on the main
    thread, which sat in select() until some event came (issue 26 item 11)."""
    (tmp_path / "forever.yaml").write_text(
        f"name: hung\nextends: {REPO / 'specs' / 'tool_agent.yaml'}\ntools:\n  - function: {FAULTY}:hang\n"
    )
    script = tmp_path / "hung.py"
    script.write_text(
        textwrap.dedent(f"""
        import asyncio, signal, threading, time
        signal.signal(signal.SIGINT, signal.default_int_handler)  # as from a shell, whatever the test process's
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {{signal.SIGINT}})  # state was at the fork
        from transformers import AutoTokenizer
        import fsm
        from tests.conftest import model_turn, scripted, tool_turn, user_row

        tok = AutoTokenizer.from_pretrained({str(ASSETS)!r})
        agent = fsm.compile_spec({str(tmp_path)!r} + "/forever.yaml")
        backend = scripted([tool_turn(tok, ("hang", {{"text": "x"}})), model_turn(tok, "done")])
        def watch():
            while not any(t.name == "agentfsm-tool-hang" for t in threading.enumerate()):
                time.sleep(0.01)
            hung = next(t for t in threading.enumerate() if t.name == "agentfsm-tool-hang")
            time.sleep(0.5)  # the loop is asleep in select() by now
            print("HUNG", flush=True)
            signal.pthread_kill(hung.ident, signal.SIGINT)  # to the tool's thread, not the main one
        threading.Thread(target=watch, daemon=True).start()
        try:
            asyncio.run(fsm.Runner(agent, backend, tok, watchdog_s=None).run([user_row()]))
        except KeyboardInterrupt:
            print("INTERRUPTED", flush=True)
    """)
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, str(script)], cwd=REPO, env=env, stdout=subprocess.PIPE, text=True
    )
    watchdog = threading.Timer(120, proc.kill)  # a script that never ends fails, never hangs
    watchdog.start()
    try:
        lines = [line.strip() for line in proc.stdout]
        proc.wait(timeout=120)
    finally:
        watchdog.cancel()
        proc.kill()
    assert lines == ["HUNG", "INTERRUPTED"], lines
