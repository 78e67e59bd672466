"""bench/engines.py over two scripted dev servers (subprocesses): each server's numbers, the tokens compared
across them, and the client under load in an engine's first batch and in its second (the steady state)."""

from __future__ import annotations

import json
import subprocess
import sys

from backends.scripted import calculator_backend, scripted_servers
from bench.engines import bench_engines


def test_bench_engines_reports_first_and_steady_batches(capsys):
    with scripted_servers(2) as urls:
        out = bench_engines(urls, n=2, repeats=1, in_flight=6)
        # one server is measured too (the dev server's row)
        alone = bench_engines(urls[:1], n=1, repeats=1, in_flight=0)["servers"]
    assert list(alone) == urls[:1] and alone[urls[0]]["client_cpu_ms_per_call"]["median"] > 0
    assert out["tokens_equal"] is True
    for url in urls:
        s = out["servers"][url]
        assert s["model_calls"] >= 2 and s["failed"] == 0 and s["in_flight_failed"] == 0
        for key in ("client_cpu_ms_per_call", "in_flight_client_cpu_ms_per_call"):
            assert s[key]["median"] > 0, key
        assert s["in_flight_steady_client_cpu_ms_per_call"]["min"] > 0
    said = capsys.readouterr().err
    assert "in an engine's first batch" in said and "in its second" in said


def test_the_calculator_server_answers_its_real_turns():
    """The instant calculator model calls the calculator on the prompt's question, then answers with the tool's
    result once it is in the prompt: the turn shape of a real calculator run, not the echo model's one turn."""
    from backends.tiny import ASSET_DIR
    from fsm.api import load_tokenizer
    from specs.calculator import SYSTEM_PROMPT, TOOL_SCHEMA

    tok = load_tokenizer(str(ASSET_DIR))
    model = calculator_backend(str(ASSET_DIR))
    asked = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": "What is 37 * 12 + 5?"},
    ]
    first = model._turn_ids(_request(tok, asked, TOOL_SCHEMA), 0)
    assert first[-1] == tok.eos_token_id
    text = tok.decode(first[:-1])
    assert (
        text
        == '<tool_call>\n{"name": "calculator", "arguments": {"expression": "37 * 12 + 5"}}\n</tool_call>'
    )
    call = {
        "type": "function",
        "function": {"name": "calculator", "arguments": {"expression": "37 * 12 + 5"}},
    }
    answered = [
        *asked,
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "449"},
    ]
    second = model._turn_ids(_request(tok, answered, TOOL_SCHEMA), 1)
    assert tok.decode(second[:-1]) == "The answer is 449.\n#### 449"


def _request(tok, messages, schema):
    from backends.base import GenerateRequest

    text = tok.apply_chat_template(messages, tools=[schema], add_generation_prompt=True, tokenize=False)
    return GenerateRequest(
        session_id="s", prompt_ids=tok.encode(text, add_special_tokens=False), sampling_params={}
    )


def test_bench_engines_without_servers_runs_the_real_turn_shape_and_names_the_echo_one():
    """`agentfsm bench engines` with no --server, as a user runs it (a real CLI process, its instant dev servers and
    collector in processes of their own): the calculator's real turns, untraced and traced, and the echo shape,
    each named, every row answered right (reward 1 on the calculator); with --processes, the rows split over two
    client processes, each against a modeled vLLM server of its own (bench/fleet_sim.py's token route), the
    servers' CPU counted; a shape it does not have is one line. ~40 s at load 5 on 2 cores, 77 s at load 11 (the
    CLI process and two clients importing the engine, three engines started, two batches each): the real command,
    as a user runs it, is the point."""
    cmd = [
        sys.executable,
        "-m",
        "fsm.cli.commands",
        "bench",
        "engines",
        "--concurrency",
        "4",
        "--repeats",
        "1",
    ]
    done = subprocess.run([*cmd, "--processes", "2"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout)
    (scaled,) = out["processes"]
    assert scaled["processes"] == 2 and scaled["failed"] == 0 and scaled["model_calls"] == 8
    for key in ("calls_per_s", "client_cpu_ms_per_call", "server_cpu_ms_per_call"):
        assert scaled[key]["median"] > 0, key
    assert "over 2 process(es), a modeled vLLM server each" in done.stderr
    shapes = out["shapes"]
    assert set(shapes) == {"calculator", "calculator, traced", "echo"}
    for name, s in shapes.items():
        assert s["failed"] == 0 and s["steady_client_cpu_ms_per_call"]["median"] > 0, name
    assert shapes["calculator"]["model_calls_per_batch"] == 8 and shapes["calculator"]["reward_mean"] == 1.0
    assert shapes["calculator, traced"]["model_calls_per_batch"] == 8
    assert shapes["echo"]["model_calls_per_batch"] == 4 and "cheapest shape" in shapes["echo"]["about"]
    assert "calculator, traced: 4 in flight, an instant server" in done.stderr
    refused = subprocess.run([*cmd[:5], "--shape", "long"], capture_output=True, text=True, timeout=300)
    assert refused.returncode != 0 and "Traceback" not in refused.stderr
    assert refused.stderr.strip().splitlines()[-1].endswith("no --shape long (engines: calculator | echo)")


def test_processes_are_counted_as_given_and_a_dead_one_is_one_line_not_a_hang():
    """`--processes 1 2 4` (one flag, several counts); a client process that dies before it reports ends the load
    with one line naming it, where the load used to wait an hour on its queue."""
    import multiprocessing

    import pytest

    from bench.engines import _take
    from fsm.cli.commands import build_parser

    assert build_parser().parse_args(["bench", "engines", "--processes", "1", "2", "4"]).processes == [
        1,
        2,
        4,
    ]
    ctx = multiprocessing.get_context("spawn")
    dead = ctx.Process(target=sys.exit, args=(3,))
    dead.start()
    with pytest.raises(RuntimeError, match=rf"client process {dead.pid} exited with code 3; its error"):
        _take(ctx.Queue(), [dead])


def test_a_modeled_server_that_cannot_start_is_one_line(monkeypatch):
    """`--processes`' modeled servers each take a free port of their own; one that cannot start (here: its port
    taken) ends the bench with one line naming it and its log's last line, not a traceback."""
    import socket

    import pytest

    import bench.fleet
    from bench.engines import modeled_servers

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))  # bound, not listening: the launcher's health checks are refused at once
        monkeypatch.setattr(bench.fleet, "free_port", lambda: taken.getsockname()[1])
        with pytest.raises(RuntimeError) as e, modeled_servers(1):
            pass
    assert str(e.value).startswith(
        "bench engines: replica 0 (http://127.0.0.1:"
    ) and "address already in use" in str(e.value)
    assert "\n" not in str(e.value)
