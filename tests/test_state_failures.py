"""Failures declared per state (fsm/spec/failures.py, fsm/run/failures.py): retry, catch, timeout_s,
heartbeat_s and on_error, with real failures: a tool that raises, one that hangs, one that stops heartbeating.
Each test checks the rows exactly: the path, the observation the model reads, masks and rewards."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from fsm.output.batch import collate, summarize
from tests.conftest import model_turn, observation_texts, run_agent, scripted, tool_turn, user_row
from tests.fixtures import flaky

FLAKY = "tests.fixtures.flaky"


@pytest.fixture(autouse=True)
def fresh_tools():
    flaky.reset()
    yield
    flaky.RELEASE.set()


def spec(processing: str, extra_states: str = "", top: str = "") -> str:
    """tool_agent with the flaky tools, PROCESSING_TOOLS' failure rules, and a TOOL_DOWN state that tells the
    model what failed and lets it answer."""
    return f"""
        name: failing
        extends: {{specs}}/tool_agent.yaml
        tools:
          - function: {FLAKY}:flaky
          - function: {FLAKY}:hang
          - class: {FLAKY}:Heart
            schema: {FLAKY}:HEART_SCHEMA
        reward:
          function: {FLAKY}:one
        {top}
        states:
          PROCESSING_TOOLS:
{processing}
{TOOL_DOWN if "catch:" in processing else ""}{extra_states}
        """


TOOL_DOWN = """\
          TOOL_DOWN:
            action: observe_error
            next:
              - to: GENERATING
"""


CATCH_EXCEPTION = """\
            catch:
              - errors: [tool.exception]
                to: TOOL_DOWN
"""


def script(tok, tool: str = "flaky") -> list[list[int]]:
    return [tool_turn(tok, (tool, {"text": "hi"})), model_turn(tok, "done")]


async def test_a_caught_tool_error_goes_to_the_catch_state_and_the_model_reads_it(tok, compile_yaml):
    flaky.reset(fail_first=10)
    agent = compile_yaml(spec(CATCH_EXCEPTION))
    [traj] = await run_agent(agent, scripted(script(tok)), tok, [user_row()])
    assert traj.error is None and traj.termination_reason == "done"
    assert traj.path == ["PENDING", "GENERATING", "PROCESSING_TOOLS", "TOOL_DOWN", "GENERATING", "TERMINATED"]
    [caught] = traj.failures  # fsm.Failure: recorded once, read by the record, the spans and observe_error
    assert (caught.handled, caught.state, caught.kind, caught.attempt, caught.to) == (
        "catch",
        "PROCESSING_TOOLS",
        "tool.exception",
        1,
        "TOOL_DOWN",
    )
    assert caught.cause == "Error executing tool 'flaky': sandbox down (call 1)"
    [seen] = observation_texts(tok, traj)
    assert "<tool_response>\nError executing tool 'flaky': sandbox down (call 1)\n</tool_response>" in seen
    assert [m["content"] for m in traj.messages if m["role"] == "tool"] == [
        "Error executing tool 'flaky': sandbox down (call 1)"
    ]
    assert flaky.CALLS == {"flaky": 1}
    catch_edge = agent.catches["PROCESSING_TOOLS"][0]
    assert catch_edge.index in traj.transitions_fired and catch_edge.label == "catch tool.exception"
    assert traj.reward_score == 1.0


async def test_a_retried_tool_error_runs_the_round_again_until_it_answers(tok, compile_yaml):
    processing = """\
            retry:
              - errors: [tool.exception]
                max_attempts: 3
                backoff_s: 0.01
                jitter: 0
"""
    agent = compile_yaml(spec(processing))
    [traj] = await run_agent(agent, scripted(script(tok)), tok, [user_row()])
    assert traj.error is None and flaky.CALLS == {"flaky": 3}
    assert [(f.handled, f.state, f.attempt) for f in traj.failures] == [
        ("retry", "PROCESSING_TOOLS", 1),
        ("retry", "PROCESSING_TOOLS", 2),
    ]
    assert [m["content"] for m in traj.messages if m["role"] == "tool"] == ["echo hi"]
    assert traj.path == ["PENDING", "GENERATING", "PROCESSING_TOOLS", "GENERATING", "TERMINATED"]


RETRY_ONCE = """\
            retry:
              - errors: [tool]
                max_attempts: 2
                backoff_s: 0
"""


@pytest.mark.parametrize("on_error", ["mask", "zero_reward", "drop"])
async def test_retries_spent_with_no_catch_fail_the_row_as_on_error_says(tok, compile_yaml, on_error):
    flaky.reset(fail_first=10)
    agent = compile_yaml(spec(RETRY_ONCE, top=f"failures: {{on_error: {on_error}}}"))
    rows = [user_row(uid="bad"), user_row(uid="good")]
    backend = scripted({0: script(tok), 1: [model_turn(tok, "done")]})
    bad, good = await run_agent(agent, backend, tok, rows)
    assert flaky.CALLS == {"flaky": 2}
    assert bad.termination_reason == (
        "error: tool.exception in PROCESSING_TOOLS: Error executing tool 'flaky': sandbox down (call 2)"
    )
    assert bad.reward_score == 0.0 and good.reward_score == 1.0
    turn = tool_turn(tok, ("flaky", {"text": "hi"}))
    if on_error == "zero_reward":  # the model's turn kept, trained towards reward 0
        assert bad.response_ids.tolist() == turn and list(bad.response_mask) == [1] * len(turn)
    else:
        assert bad.response_ids.tolist() == [] and list(bad.response_mask) == []
    out = collate([bad, good], prompt_length=1024, response_length=1024, pad_token_id=tok.pad_token_id)
    mask = out.batch["response_mask"]
    summary = summarize([bad, good])
    if on_error == "drop":
        assert mask.shape[0] == 1 and list(out.non_tensor_batch["uid"]) == ["good"]
        assert summary["dropped"] == 1 and summary["dropped_rows"] == ["bad"]
    else:
        assert mask.shape[0] == 2 and summary["dropped"] == 0
        assert int(np.asarray(mask[0]).sum()) == (len(turn) if on_error == "zero_reward" else 0)
        assert np.asarray(out.batch["rm_scores"][0]).sum() == 0.0


async def test_a_states_own_on_error_wins_over_the_spec_wide_one_for_rows_failing_there(tok, compile_yaml):
    """PROCESSING_TOOLS says zero_reward, the spec says drop: a row failing in PROCESSING_TOOLS keeps its
    tokens with reward 0; a row failing in GENERATING (its server has no turn for it) is dropped."""
    flaky.reset(fail_first=10)
    agent = compile_yaml(
        spec(RETRY_ONCE + "            on_error: zero_reward\n", top="failures: {on_error: drop}")
    )
    assert agent.spec.states["PROCESSING_TOOLS"].on_error == "zero_reward"
    rows = [user_row(uid="tools"), user_row(uid="server"), user_row(uid="good")]
    backend = scripted({0: script(tok), 1: [], 2: [model_turn(tok, "done")]})
    tools, server, good = await run_agent(agent, backend, tok, rows)
    assert tools.termination_reason.startswith("error: tool.exception in PROCESSING_TOOLS")
    assert server.error is not None and server.state == "GENERATING"
    turn = tool_turn(tok, ("flaky", {"text": "hi"}))
    assert tools.response_ids.tolist() == turn and list(tools.response_mask) == [1] * len(turn)
    assert tools.failure.on_error == "zero_reward" and server.failure.on_error == "drop"
    assert (tools.failure.kind, tools.failure.attempt) == ("tool.exception", 2)  # past RETRY_ONCE's two
    assert server.failure.kind == "backend" and good.failure is None and good.error is None
    out = collate(
        [tools, server, good], prompt_length=1024, response_length=1024, pad_token_id=tok.pad_token_id
    )
    assert list(out.non_tensor_batch["uid"]) == ["tools", "good"]
    assert int(np.asarray(out.batch["response_mask"][0]).sum()) == len(turn)
    assert np.asarray(out.batch["rm_scores"][0]).sum() == 0.0
    summary = summarize([tools, server, good])
    assert summary["dropped"] == 1 and summary["dropped_rows"] == ["server"]


async def test_a_state_timeout_caught_tells_the_model_the_tool_hung(tok, compile_yaml):
    processing = """\
            timeout_s: 0.3
            catch:
              - errors: [timeout]
                to: TOOL_DOWN
"""
    agent = compile_yaml(spec(processing))
    [traj] = await run_agent(agent, scripted(script(tok, "hang")), tok, [user_row()])
    assert traj.error is None and traj.failures[-1].kind == "timeout"
    assert [m["content"] for m in traj.messages if m["role"] == "tool"] == [
        "Error: action of PROCESSING_TOOLS exceeded timeout_s 0.3s"
    ]


async def test_a_state_timeout_uncaught_ends_the_row_naming_it(tok, compile_yaml):
    agent = compile_yaml(spec("            timeout_s: 0.2\n"))
    [traj] = await run_agent(agent, scripted(script(tok, "hang")), tok, [user_row()])
    assert traj.termination_reason == "error: timeout: action of PROCESSING_TOOLS exceeded timeout_s 0.2s"


def heart_spec(beats: int, quiet: bool) -> str:
    processing = """\
            heartbeat_s: 0.3
            catch:
              - errors: [heartbeat]
                to: TOOL_DOWN
"""
    text = spec(processing)
    return text.replace(
        f"schema: {FLAKY}:HEART_SCHEMA",
        f"schema: {FLAKY}:HEART_SCHEMA\n            config: {{beats: {beats}, every_s: 0.1, quiet: {str(quiet).lower()}}}",
    )


async def test_a_tool_that_stops_heartbeating_is_failed_after_the_interval(tok, compile_yaml):
    agent = compile_yaml(heart_spec(beats=3, quiet=True))
    [traj] = await run_agent(agent, scripted(script(tok, "heart")), tok, [user_row()])
    assert traj.failures[-1].kind == "heartbeat"
    assert [m["content"] for m in traj.messages if m["role"] == "tool"] == [
        "Error: no heartbeat from the tools of PROCESSING_TOOLS for 0.3s (heartbeat_s)"
    ]


async def test_a_tool_that_heartbeats_runs_past_the_interval(tok, compile_yaml):
    agent = compile_yaml(heart_spec(beats=6, quiet=False))  # 0.6 s of work, a beat every 0.1 s
    [traj] = await run_agent(agent, scripted(script(tok, "heart")), tok, [user_row()])
    assert traj.failures == [] and traj.error is None
    assert [m["content"] for m in traj.messages if m["role"] == "tool"] == ["beat 6 times"]


def beat_spec(tool: str) -> str:
    """heart_spec's rules, with the plain function `tool` in the class tool's place."""
    return heart_spec(0, True).replace(
        f"class: {FLAKY}:Heart\n            schema: {FLAKY}:HEART_SCHEMA\n            config: {{beats: 0, every_s: 0.1, quiet: true}}",
        f"function: {FLAKY}:{tool}",
    )


@pytest.mark.parametrize("tool", ["fade", "afade"])
async def test_a_function_tool_that_stops_calling_fsm_heartbeat_is_failed_within_the_interval(
    tok, compile_yaml, tool
):
    agent = compile_yaml(beat_spec(tool))
    assert tool in agent.tools.by_name and "heart" not in agent.tools.by_name
    [traj] = await run_agent(agent, scripted(script(tok, tool)), tok, [user_row()])
    ended = time.monotonic()
    assert traj.failures[-1].kind == "heartbeat"
    assert [m["content"] for m in traj.messages if m["role"] == "tool"] == [
        "Error: no heartbeat from the tools of PROCESSING_TOOLS for 0.3s (heartbeat_s)"
    ]
    beats = flaky.BEATS[tool]
    assert [ok for _, ok in beats] == [True] * 3  # each reached the trajectory
    assert ended - beats[-1][0] < 0.3 + 2.0  # failed 0.3 s after its last beat, not after its 30 s


@pytest.mark.parametrize("tool", ["pulse", "apulse"])
async def test_a_function_tool_that_calls_fsm_heartbeat_runs_past_the_interval(tok, compile_yaml, tool):
    agent = compile_yaml(beat_spec(tool))
    [traj] = await run_agent(agent, scripted(script(tok, tool)), tok, [user_row()])
    assert traj.failures == [] and traj.error is None
    assert [m["content"] for m in traj.messages if m["role"] == "tool"] == ["pulsed 6 times"]
    assert [ok for _, ok in flaky.BEATS[tool]] == [True] * 6


def test_fsm_heartbeat_outside_a_tool_call_does_nothing():
    import fsm

    assert fsm.heartbeat() is False


def test_a_spec_without_failure_rules_hashes_as_before(compile_yaml):
    plain = compile_yaml(spec("            description: tools\n"), "a.yaml")
    explicit = compile_yaml(
        spec("            description: tools\n            retry: []\n", top="failures: {on_error: mask}"),
        "b.yaml",
    )
    assert plain.hash == explicit.hash and not plain.ruled
    ruled = compile_yaml(spec(CATCH_EXCEPTION), "c.yaml")
    assert ruled.hash != plain.hash and ruled.ruled == {"PROCESSING_TOOLS"}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("spec_rate", "flag", "code", "says"),
    [
        ("1.0", [], 0, "agentfsm: warning: all 2 rows failed"),
        ("0.5", [], 1, "more than the spec's failures.max_error_rate 0.5"),
        ("1.0", ["--max-error-rate", "0.5"], 1, "more than --max-error-rate 0.5"),
    ],
)
def test_the_failure_budget_is_the_specs_unless_the_flag_overrides_it(
    tmp_path, capsys, spec_rate, flag, code, says
):
    from fsm.cli.commands import main
    from tests.test_cli import SPEC, _ThreadServer, run_argv

    spec_path = tmp_path / "budget.yaml"
    spec_path.write_text(f"name: budget\nextends: {SPEC}\nfailures:\n  max_error_rate: {spec_rate}\n")
    server = _ThreadServer(scripted(lambda row, sample, turn, prompt: [999_999]))  # ids past the vocabulary
    try:
        argv = run_argv(
            server.url, tmp_path / "out", "--num-prompts", "2", "-q", "--retry-window", "1", *flag
        )
        argv[1] = str(spec_path)
        assert main(argv) == code
    finally:
        server.close()
    assert says in capsys.readouterr().err


async def test_render_run_shows_retries_and_catches_on_the_diagram(tok, compile_yaml):
    from fsm.output.rundir import run_stats
    from viz.diagram import diagram

    flaky.reset(fail_first=10)
    processing = RETRY_ONCE + CATCH_EXCEPTION.replace("tool.exception", "tool")
    agent = compile_yaml(spec(processing))
    trajs = await run_agent(agent, scripted(script(tok)), tok, [user_row(), user_row()])
    assert [[(f.handled, f.state) for f in t.failures] for t in trajs] == [
        [("retry", "PROCESSING_TOOLS"), ("catch", "PROCESSING_TOOLS")]
    ] * 2
    stats = run_stats(agent, trajs)
    assert stats["states"]["PROCESSING_TOOLS"]["retries"] == 2
    assert stats["states"]["PROCESSING_TOOLS"]["catches"] == 2
    catch = agent.catches["PROCESSING_TOOLS"][0]
    assert stats["edges"][str(catch.index)]["count"] == 2
    source = diagram(agent, stats).source
    assert "retries: 2" in source and "caught: 2" in source
    assert 'label="catch tool\n2× · 100%"' in source and "style=dotted" in source


def generating_spec(attempts: int, catch: bool) -> str:
    rules = f"""\
            retry:
              - errors: [backend]
                max_attempts: {attempts}
                backoff_s: 0.01
"""
    if catch:
        rules += """\
            catch:
              - errors: [backend]
                to: TERMINATED
                reason: server_down
"""
    return f"""
        name: flaky_server
        extends: {{specs}}/tool_agent.yaml
        reward:
          function: {FLAKY}:one
        states:
          GENERATING:
{rules}
        """


@pytest.mark.parametrize(("outages", "catch"), [(3, False), (6, True)])
async def test_a_server_that_fails_n_times_then_answers_is_retried_by_the_state(
    tok, compile_yaml, outages, catch
):
    """Real HTTP: a dev server behind the fault proxy answers its first `outages` /generate 503; the client
    and the router do not retry (max_retries 0), so each 503 reaches the state's retry rule."""
    from backends.devserver import DevServer
    from backends.faults import FaultProxy
    from backends.router import Router
    from backends.sglang import SGLangBackend

    agent = compile_yaml(generating_spec(attempts=4, catch=catch))
    answer = model_turn(tok, "done")
    async with (
        DevServer(scripted([answer])) as dev,
        FaultProxy(dev.url, script=["http_503"] * outages) as proxy,
    ):
        backend = Router(
            [SGLangBackend(proxy.url, max_retries=0)],
            health_interval_s=0,
            max_retries=0,
            retry_window_s=0,
            cooldown_s=0,
        )
        try:
            [traj] = await run_agent(agent, backend, tok, [user_row()])
        finally:
            await backend.close()
    if not catch:  # 3 outages, 4 attempts: the 4th answers
        assert proxy.injected["http_503"] == 3 and [f.handled for f in traj.failures][:3] == ["retry"] * 3
        assert traj.error is None and traj.termination_reason == "done"
        assert traj.response_ids.tolist() == answer and list(traj.response_mask) == [1] * len(answer)
        assert traj.reward_score == 1.0
    else:  # 6 outages, 4 attempts: caught to TERMINATED, with no model token
        assert proxy.injected["http_503"] == 4 and [f.handled for f in traj.failures][:3] == ["retry"] * 3
        assert traj.error is None and traj.termination_reason == "server_down"
        assert traj.path == ["PENDING", "GENERATING", "TERMINATED"]
        assert traj.response_ids.tolist() == [] and traj.failures[-1].kind == "backend"
        assert traj.failures[-1].handled == "catch" and "503" in traj.failures[-1].cause


async def test_spans_record_retries_and_catches(tok, compile_yaml):
    import fsm
    from fsm.telemetry import Telemetry

    flaky.reset(fail_first=10)
    agent = compile_yaml(spec(RETRY_ONCE + CATCH_EXCEPTION.replace("tool.exception", "tool")))
    with Telemetry(otlp=False, memory=True) as tel:
        await fsm.Runner(agent, scripted(script(tok)), tok, tracer=tel).run([user_row()])
        spans = tel.finished_spans()
    [root] = [s for s in spans if s.parent is None]
    assert root.attributes["agentfsm.retries"] == 1 and root.attributes["agentfsm.catches"] == 1
    events = [(e.name, dict(e.attributes)) for e in root.events]
    message = "Error executing tool 'flaky': sandbox down (call {})"
    assert events == [
        (
            "agentfsm.retry",
            {
                "agentfsm.failure.state": "PROCESSING_TOOLS",
                "agentfsm.failure.error": "tool.exception",
                "agentfsm.failure.attempt": 1,
                "agentfsm.failure.message": message.format(1),
            },
        ),
        (
            "agentfsm.catch",
            {
                "agentfsm.failure.state": "PROCESSING_TOOLS",
                "agentfsm.failure.error": "tool.exception",
                "agentfsm.failure.attempt": 2,
                "agentfsm.failure.message": message.format(2),
                "agentfsm.failure.to": "TOOL_DOWN",
            },
        ),
    ]
    [catch] = [s for s in spans if s.name == "PROCESSING_TOOLS -> TOOL_DOWN"]
    assert catch.attributes["fsm.catch.errors"] == "tool" and catch.attributes["fsm.guard"] == "catch tool"


async def test_every_row_dropped_is_an_empty_batch_and_the_summary_names_them(tok, compile_yaml):
    flaky.reset(fail_first=10)
    agent = compile_yaml(spec(RETRY_ONCE, top="failures: {on_error: drop}"))
    trajs = await run_agent(agent, scripted(script(tok)), tok, [user_row(uid="a"), user_row(uid="b")])
    out = collate(trajs, prompt_length=1024, response_length=1024, pad_token_id=tok.pad_token_id)
    assert out.batch["response_mask"].shape[0] == 0
    assert summarize(trajs)["dropped_rows"] == ["a", "b"]


async def test_drop_under_verls_dataproto_is_refused_in_one_line(tok, compile_yaml):
    from fsm.families import codec_for
    from fsm.output.batch import to_batch
    from tests.test_api import DataProto

    flaky.reset(fail_first=10)
    agent = compile_yaml(spec(RETRY_ONCE, top="failures: {on_error: drop}"))
    trajs = await run_agent(agent, scripted(script(tok)), tok, [user_row(uid="a")])
    like = DataProto(non_tensor_batch={}, meta_info={})
    with pytest.raises(ValueError, match=r"^failures.on_error: drop left out rows \['a'\], but verl's"):
        to_batch(trajs, agent, codec_for(tok), logprobs=True, like=like)


async def test_a_failure_is_one_value_that_every_output_reads_by_its_kind(tok, compile_yaml):
    """A row's failure (fsm.Failure) is recorded once, where it happens; the metrics, the summary and the fault
    summary group by its kind, as the root span's error.type does. Each parsed the message before, so one bad row
    was `error_bad`, `error: bad row bad`, `bad row bad` and `bad_row`."""
    from fsm.output.batch import fault_summary, rollout_metrics

    flaky.reset(fail_first=10)
    agent = compile_yaml(spec(RETRY_ONCE))
    rows = [user_row(uid="tools"), user_row(uid="server"), user_row(uid="bad", tools_kwargs="abc")]
    trajs = await run_agent(agent, scripted({0: script(tok), 1: []}), tok, rows)
    kinds = ["tool.exception", "backend", "bad_row"]
    assert [(t.failure.kind, t.failure.state, t.failure.attempt) for t in trajs] == [
        ("tool.exception", "PROCESSING_TOOLS", 2),  # past RETRY_ONCE's two attempts
        ("backend", "GENERATING", 1),
        ("bad_row", "PENDING", 1),
    ]
    assert trajs[2].error.startswith("bad row bad: 'tools_kwargs'") and trajs[2].failures == []
    metrics = rollout_metrics(trajs)
    assert [metrics[f"rollout/termination/error_{k}"] for k in kinds] == [1.0] * 3
    assert summarize(trajs)["termination_reasons"] == {f"error: {k}": 1 for k in kinds}
    assert fault_summary(trajs, {})["error_reasons"] == {k: 1 for k in kinds}


async def test_a_states_retries_of_a_model_turn_stay_within_its_turn_timeout(tok, compile_yaml):
    """limits.turn_timeout_s bounds a model turn end to end: a state's retry of the turn runs within its first
    attempt's deadline. Each retry had a deadline of its own before, so a server failing after 0.3 s was asked
    all 10 times (3 s) past a 1 s turn deadline, each retry re-opening the router's retry window."""
    from backends.base import BackendUnavailable

    agent = compile_yaml(generating_spec(attempts=10, catch=False) + "limits: {turn_timeout_s: 1.0}\n")
    backend, asked = scripted([]), []

    async def down(request):
        await asyncio.sleep(0.3)
        asked.append(request)
        raise BackendUnavailable("503 from the only server")

    backend.generate = down
    [traj] = await run_agent(agent, backend, tok, [user_row()])
    assert traj.failure.kind == "timeout" and "exceeded limits.turn_timeout_s 1 s" in traj.error, traj.error
    assert 1 <= len(asked) <= 4 and len(traj.failures) == 9  # asked within 1 s; the rest timed out at once
    assert [f.kind for f in traj.failures][-1] == "backend.timeout"
