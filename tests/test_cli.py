"""`agentfsm` as a user meets it: every user error is one line on stderr with a non-zero exit and no
traceback; numeric flags are range-checked; `run` writes its outputs so that a directory never holds a
mix of two runs; `--max-error-rate`; `show --limit` and the ground truth; help, defaults and --version.

Most cases run `fsm.cli.commands.main` in process (fast). Runs that need a model use the scripted echo model behind
an in-process dev server (`--server`), so no test here loads the tiny model.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import json
import os
import signal
import subprocess
import sys
import threading
import zlib

import pytest

from backends.devserver import DevServer
from backends.scripted import ScriptedBackend, echo_backend
from fsm.cli.args import Parser
from fsm.cli.commands import build_parser, main
from tests.conftest import ASSETS, REPO

SPEC = str(REPO / "specs" / "calculator.yaml")
TOOL_AGENT = str(REPO / "specs" / "tool_agent.yaml")


def one_line_error(capsys, argv: list[str]) -> str:
    """Run the CLI; assert it failed with exactly one line on stderr and no traceback; that line."""
    code = main(argv)
    captured = capsys.readouterr()
    assert code != 0, captured
    assert "Traceback" not in captured.err + captured.out
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    return lines[0]


# --- numeric flags ---------------------------------------------------------------------------------------

BAD_NUMBERS = [
    (["run", SPEC, "--concurrency", "0"], "--concurrency"),
    (["run", SPEC, "--num-prompts", "-1"], "--num-prompts"),
    (["run", SPEC, "--num-prompts", "0"], "--num-prompts"),
    (["run", SPEC, "--n", "0"], "--n"),
    (["run", SPEC, "--n", "two"], "--n"),
    (["run", SPEC, "--dp", "0"], "--dp"),
    (["run", SPEC, "--tp", "0"], "--tp"),
    (["run", SPEC, "--port", "0"], "--port"),
    (["run", SPEC, "--port", "70000"], "--port"),
    (["run", SPEC, "--temperature", "-0.5"], "--temperature"),
    (["run", SPEC, "--temperature", "nan"], "--temperature"),
    (["run", SPEC, "--seed", "-1"], "--seed"),
    (["run", SPEC, "--threads", "0"], "--threads"),
    (["run", SPEC, "--batch-size", "0"], "--batch-size"),
    (["run", SPEC, "--request-timeout", "0"], "--request-timeout"),
    (["run", SPEC, "--request-timeout", "inf"], "--request-timeout"),
    (["run", SPEC, "--max-error-rate", "1.5"], "--max-error-rate"),
    (["run", SPEC, "--trace-sample", "2"], "--trace-sample"),
    (["run", SPEC, "--workers", "0"], "--workers"),
    (["show", "runs/latest", "--row", "-1"], "--row"),
    (["show", "runs/latest", "--limit", "0"], "--limit"),
    (["bench", "engine", "--n", "0"], "--n"),
    (["bench", "engine", "--concurrency", "0"], "--concurrency"),
    (["bench", "engine", "--tool-turns", "-1"], "--tool-turns"),
    (["bench", "engine", "--repeats", "0"], "--repeats"),
    (["dev-server", "--port", "-5"], "--port"),
]


@pytest.mark.parametrize(
    ("argv", "flag"), BAD_NUMBERS, ids=[" ".join(a[2:] if a[0] == "run" else a) for a, _ in BAD_NUMBERS]
)
def test_numeric_flags_out_of_range_are_refused(capsys, argv, flag):
    line = one_line_error(capsys, argv)
    assert f"argument {flag}:" in line and "--help" in line


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_every_numeric_flag_is_range_checked_and_every_argument_documented():
    parser = build_parser()
    commands = _subparsers(parser)
    assert set(commands) == {
        "validate",
        "schema",
        "run",
        "render",
        "show",
        "bench",
        "dev-server",
        "gateway",
        "replay",
    }
    for name, sub in commands.items():
        assert isinstance(sub, Parser) and sub.description, name  # one-line usage errors; a description
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            assert action.help, f"{name} {action.dest}: no help text"
            assert action.type not in (int, float), f"{name} {action.dest}: a plain {action.type.__name__}"
            if action.default not in (None, False) and action.default is not argparse.SUPPRESS:
                assert (
                    "%(default)" in sub.formatter_class(name)._get_help_string(action)
                    or "default" in action.help
                )


def test_help_shows_defaults_and_version(capsys):
    assert main(["run", "--help"]) == 0
    text = capsys.readouterr().out
    assert "(default: 256)" in text and "(default: runs/latest)" in text and "SPEC" in text
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"agentfsm {importlib.metadata.version('agentfsm')}"


def test_no_command_is_one_line(capsys):
    assert "required" in one_line_error(capsys, [])


# --- one-line errors -------------------------------------------------------------------------------------


def test_render_unsupported_format(capsys, tmp_path):
    line = one_line_error(capsys, ["render", TOOL_AGENT, "-o", str(tmp_path / "x.jpg")])
    assert "x.jpg" in line and "'.jpg'" in line


def test_render_missing_run_dir(capsys, tmp_path):
    line = one_line_error(capsys, ["render", TOOL_AGENT, "--run", "/missing", "-o", str(tmp_path / "x.svg")])
    assert "/missing" in line and "--out DIR" in line


def test_render_run_whose_summary_is_not_an_object(capsys, tmp_path):
    """A summary.json that is JSON but not an object (a list): one line naming it, not an AttributeError."""
    (tmp_path / "summary.json").write_text("[]\n")
    line = one_line_error(
        capsys, ["render", TOOL_AGENT, "--run", str(tmp_path), "-o", str(tmp_path / "x.dot")]
    )
    assert "summary.json" in line and '"fsm"' in line


def test_render_without_graphviz_dot(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no `dot` there
    line = one_line_error(capsys, ["render", TOOL_AGENT, "-o", str(tmp_path / "x.svg")])
    assert "x.svg" in line and "`dot`" in line and "graphviz" in line


def test_show_missing_dir(capsys):
    line = one_line_error(capsys, ["show", "/missing"])
    assert "/missing" in line and "agentfsm run --out DIR" in line  # a flag that exists


def test_show_a_file_that_is_not_a_run(capsys, tmp_path):
    bad = tmp_path / "notes.txt"
    bad.write_text("hello\n")
    line = one_line_error(capsys, ["show", str(bad)])
    assert f"{bad}:1:" in line


def test_schema_to_a_missing_directory(capsys, tmp_path):
    assert "/nowhere/schema.json" in one_line_error(
        capsys, ["schema", "-o", str(tmp_path / "nowhere" / "schema.json")]
    )


def test_run_out_is_a_file(capsys, tmp_path):
    out = tmp_path / "file"
    out.write_text("")
    assert f"--out {out}" in one_line_error(capsys, ["run", SPEC, "--out", str(out)])


def test_run_ray_without_ray(capsys, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    line = one_line_error(capsys, ["run", SPEC, "--ray", "--out", str(tmp_path)])
    assert line.startswith("agentfsm: --ray:") and "pip install" in line


def test_request_timeout_needs_servers(capsys, tmp_path):
    assert "--request-timeout" in one_line_error(
        capsys, ["run", SPEC, "--request-timeout", "5", "--out", str(tmp_path)]
    )


def test_exact_logprobs_is_the_embedded_models_mode(capsys, tmp_path):
    line = one_line_error(
        capsys, ["run", SPEC, "--exact-logprobs", "--server", "http://127.0.0.1:1", "--out", str(tmp_path)]
    )
    assert line.startswith("agentfsm: --exact-logprobs: it is the embedded model's mode") and "docs/" in line


def test_a_run_builds_only_its_own_flags_and_no_otel_sdk(monkeypatch):
    """A run's command line builds no other command's flags and parses as the whole one does; with no OTEL_*
    variable set, deciding on tracing imports no SDK (fsm.telemetry.config made unimportable here)."""
    from fsm.cli.args import env_tracing

    argv = ["run", SPEC, "--server", "http://127.0.0.1:1"]
    lean = _subparsers(build_parser(argv))
    assert [a.dest for a in lean["gateway"]._actions] == ["help"] and len(lean["run"]._actions) > 20
    assert vars(build_parser(argv).parse_args(argv)) == vars(build_parser().parse_args(argv))
    for name in [k for k in os.environ if k.startswith("OTEL_")]:
        monkeypatch.delenv(name)
    with monkeypatch.context() as m:
        m.setitem(sys.modules, "fsm.telemetry.config", None)
        assert env_tracing() is False
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4318")
    assert env_tracing() is True


def test_request_timeout_and_group_affinity_reach_the_engine(monkeypatch, tmp_path):
    """Until backends take `request_timeout_s`, check that the CLI hands it to RolloutEngine's backend options
    (and only when given)."""
    import fsm.api
    from fsm.cli import commands as cli

    seen: list[dict] = []

    class Stop(Exception):
        pass

    def engine(*args, **kwargs):
        seen.append(kwargs)
        raise Stop

    monkeypatch.setattr(fsm.api, "RolloutEngine", engine)
    ns = build_parser().parse_args(
        ["run", SPEC, "--server", "http://127.0.0.1:1", "--request-timeout", "2.5"]
    )
    with pytest.raises(Stop):
        cli._engine(ns, ["http://127.0.0.1:1"], str(ASSETS))
    ns = build_parser().parse_args(["run", SPEC, "--server", "http://127.0.0.1:1"])
    with pytest.raises(Stop):
        cli._engine(ns, ["http://127.0.0.1:1"], str(ASSETS))
    assert seen[0]["request_timeout_s"] == 2.5 and "request_timeout_s" not in seen[1]
    assert seen[1]["group_affinity"] is True  # on by default, as in the Python API
    ns = build_parser().parse_args(["run", SPEC, "--server", "http://127.0.0.1:1", "--no-group-affinity"])
    with pytest.raises(Stop):
        cli._engine(ns, ["http://127.0.0.1:1"], str(ASSETS))
    assert seen[2]["group_affinity"] is False


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_launch_without_the_engine_shows_the_cause(capsys, tmp_path, engine):
    """--launch-sglang and --launch-vllm (one launch path, fsm/cli/launch.py) end in one line naming the cause."""
    pytest.importorskip("aiohttp")
    if importlib.util.find_spec(engine) is not None:
        pytest.skip(f"{engine} is installed here")
    python = [f"--{engine}-python", sys.executable]
    line = one_line_error(
        capsys,
        ["run", SPEC, f"--launch-{engine}", str(tmp_path / "model"), *python, "--port", "39871"]
        + ["--out", str(tmp_path / "out")],
    )
    assert line.startswith(f"agentfsm: --launch-{engine}: replica 0")
    assert "No module named" in line and engine in line  # the cause, not "ends with:"
    assert not line.endswith(":")


def test_trace_sample_without_tracing_warns(capsys, monkeypatch, tmp_path):
    from fsm.cli.args import check_run_flags

    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", raising=False)
    check_run_flags(build_parser().parse_args(["run", SPEC, "--trace-sample", "0.1"]))
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "warning: --trace-sample does nothing" in err
    check_run_flags(build_parser().parse_args(["run", SPEC, "--trace-sample", "0.1", "--trace", "console"]))
    assert capsys.readouterr().err == ""


def test_a_subprocess_error_is_one_line_too(tmp_path):
    """The installed entry point's path: `python -m fsm.cli.commands` in this checkout."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-m", "fsm.cli.commands", "run", SPEC, "--concurrency", "0"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.splitlines() == [
        "agentfsm run: error: argument --concurrency: must be an integer >= 1, got 0 (see agentfsm run --help)"
    ]


# --- show ----------------------------------------------------------------------------------------------


@pytest.fixture
def fake_run(tmp_path):
    """A run directory with 8 records: rewards 0/1 alternating, answers and ground truths."""
    run = tmp_path / "run"
    run.mkdir()
    with (run / "trajectories.jsonl").open("w") as f:
        for i in range(8):
            record = {
                "index": i,
                "uid": f"u{i}",
                "sample": 0,
                "termination_reason": "done",
                "reward_score": float(i % 2),
                "ground_truth": str(100 + i),
                "state_path": ["PENDING", "TERMINATED"],
                "num_turns": 1,
                "error": None,
                "prompt": f"What is {i}?",
                "prompt_tokens": 4,
                "turns": [
                    {
                        "role": "assistant",
                        "text": f"thinking\n#### {100 + i}<|im_end|>",
                        "mask": 1,
                        "n_tokens": 5,
                    }
                ],
            }
            f.write(json.dumps(record) + "\n")
    return run


def test_show_row_not_in_the_run(capsys, fake_run):
    line = one_line_error(capsys, ["show", str(fake_run), "--row", "999"])
    assert "no row 999" in line and "0..7" in line


def test_show_worst_is_limited_and_shows_the_ground_truth(capsys, fake_run):
    assert main(["show", str(fake_run), "--worst"]) == 0
    out = capsys.readouterr().out
    assert out.count("=== trajectory") == 5 and "(showed 5 of 8; --limit N shows more)" in out
    assert "answer: #### 100   ground truth: 100" in out
    assert main(["show", str(fake_run), "--worst", "--limit", "2"]) == 0
    assert capsys.readouterr().out.count("=== trajectory") == 2
    assert main(["show", str(fake_run)]) == 0  # no filter: every transcript
    assert capsys.readouterr().out.count("=== trajectory") == 8


# --- run: outputs ---------------------------------------------------------------------------------------


class _ThreadServer:
    """A DevServer on its own loop in a thread, so the CLI (which runs asyncio.run) can talk to it."""

    def __init__(self, backend):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._main, daemon=True)
        self.thread.start()
        self.server = DevServer(backend)
        asyncio.run_coroutine_threadsafe(self.server.start(), self.loop).result(30)
        self.url = self.server.url

    def _main(self):
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})  # as a server process would: not ours
        self.loop.run_forever()

    def close(self):
        asyncio.run_coroutine_threadsafe(self.server.close(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()
        self.loop.close()


@pytest.fixture
def echo_server():
    server = _ThreadServer(echo_backend())
    yield server.url
    server.close()


def run_argv(url: str, out, *extra: str) -> list[str]:
    return ["run", SPEC, "--server", url, "--tokenizer", str(ASSETS), "--out", str(out), *extra]


def read_summary(out) -> dict:
    return json.loads((out / "summary.json").read_text())


def assert_consistent(out, rows: int, status: str = "completed") -> dict:
    """summary.json describes exactly the files beside it, and no staging directory is left."""
    import torch

    summary = read_summary(out)
    assert summary["status"] == status
    assert summary["files"] == {"batch.pt": {"rows": rows}, "trajectories.jsonl": {"rows": rows}}
    assert len((out / "trajectories.jsonl").read_text().splitlines()) == rows
    assert torch.load(out / "batch.pt", weights_only=False)["batch"]["responses"].shape[0] == rows
    assert (
        sorted(p.name for p in out.iterdir())
        == [
            ".agentfsm.lock",
            "batch.pt",
            "journal.log",  # every step of the run (fsm/run/journal.py): ended when completed, else for run --resume
            "summary.json",
            "trajectories.jsonl",
        ]
    )  # the lock: fsm/output/rundir.py's `locked`
    return summary


def test_quiet_run_prints_only_the_wrote_line_and_a_rerun_replaces_it(capsys, echo_server, tmp_path):
    out = tmp_path / "out"
    assert main(run_argv(echo_server, out, "--num-prompts", "6", "-q")) == 0
    captured = capsys.readouterr()
    assert captured.out == f"wrote {out}/batch.pt, trajectories.jsonl, summary.json\n" and captured.err == ""
    first = assert_consistent(out, 6)
    assert first["rows_expected"] == 6 and first["error_rate"] == 0.0
    assert main(run_argv(echo_server, out, "--num-prompts", "3", "--n", "2")) == 0
    captured = capsys.readouterr()
    assert "┃ metric" in captured.out and captured.out.endswith("(replacing the run there)\n")
    assert "Loading weights" not in captured.out + captured.err
    assert_consistent(out, 6)
    assert read_summary(out)["rows_expected"] == 6 and read_summary(out)["trajectories"] == 6


def test_interrupt_while_writing_leaves_the_previous_run(capsys, echo_server, tmp_path, monkeypatch):
    out = tmp_path / "out"
    assert main(run_argv(echo_server, out, "--num-prompts", "4", "-q")) == 0
    before = {name: (out / name).read_bytes() for name in ("batch.pt", "trajectories.jsonl", "summary.json")}
    capsys.readouterr()
    import torch

    def interrupted_save(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", interrupted_save)
    line = one_line_error(capsys, run_argv(echo_server, out, "--num-prompts", "2", "-q"))
    assert "interrupted while writing" in line and str(out) in line
    assert {name: (out / name).read_bytes() for name in before} == before
    assert_consistent(out, 4)


def test_interrupt_during_the_swap_finishes_it_first(capsys, echo_server, tmp_path, monkeypatch):
    import fsm.output.rundir

    out = tmp_path / "out"
    assert main(run_argv(echo_server, out, "--num-prompts", "4", "-q")) == 0
    real_replace = os.replace
    calls = []

    def replace(src, dst):
        if not calls:
            signal.raise_signal(signal.SIGINT)  # Ctrl-C between the renames
        calls.append(dst)
        real_replace(src, dst)

    monkeypatch.setattr(fsm.output.rundir.os, "replace", replace)
    code = main(run_argv(echo_server, out, "--num-prompts", "2", "-q"))
    assert code == 130 and len(calls) == 3
    assert "the run had finished and is written" in capsys.readouterr().err
    assert_consistent(out, 2)


def test_ctrl_c_during_the_rollout_writes_what_finished(capsys, tmp_path):
    """A real SIGINT after the third request: the trajectories that finished are written, marked."""
    calls = []

    def turn(session_id, turn, prompt):
        calls.append(session_id)
        if len(calls) == 3:
            os.kill(os.getpid(), signal.SIGINT)  # as Ctrl-C sends it: to the process
        seed = zlib.crc32(b",".join(str(t).encode() for t in prompt))
        return [10 + (seed + 7919 * k) % 500 for k in range(8)] + [2]  # plain ids of the tiny tokenizer

    server = _ThreadServer(ScriptedBackend(turn, latency_s=0.05, model_name="echo"))
    try:
        out = tmp_path / "out"
        code = main(run_argv(server.url, out, "--num-prompts", "8", "--concurrency", "1", "-q"))
    finally:
        server.close()
    captured = capsys.readouterr()
    assert code == 130 and "Traceback" not in captured.err
    stopping, wrote, interrupted = (
        captured.err.splitlines()
    )  # at once, when the snapshot is written, at the end
    assert "SIGINT: stopping" in stopping and "Ctrl-C again to exit at once" in stopping
    assert wrote.startswith("agentfsm: flushed the journal")
    assert "interrupted:" in interrupted and "of 8 trajectories finished" in interrupted
    summary = read_summary(out)
    rows = summary["files"]["batch.pt"]["rows"]
    assert 1 <= rows < 8 and summary["rows_expected"] == 8
    assert_consistent(out, rows, status="interrupted")


@pytest.mark.slow
def test_dead_servers_exceed_the_error_rate(capsys, tmp_path, monkeypatch):
    import fsm.api

    async def ready(urls, **_):  # the server "answered /ready", then died
        return fsm.api.Probe(list(urls), None, {})

    monkeypatch.setattr(fsm.api, "probe_servers", ready)
    out = tmp_path / "out"
    dead = "http://127.0.0.1:9"
    line = one_line_error(capsys, run_argv(dead, out, "--num-prompts", "2", "-q", "--retry-window", "1"))
    assert "2 of 2 rows ended in error (100%), more than --max-error-rate 0.5" in line and dead in line
    summary = assert_consistent(out, 2)
    assert summary["error_rate"] == 1.0 and summary["failed"] == 2
    assert (
        main(run_argv(dead, out, "--num-prompts", "1", "-q", "--max-error-rate", "1", "--retry-window", "1"))
        == 0
    )


def test_bench_prints_json_on_stdout_and_its_table_on_stderr():
    """`agentfsm bench ... | jq` works: stdout is the JSON alone, the human-readable line goes to stderr."""
    proc = subprocess.run(
        [sys.executable, "-m", "fsm.cli.commands", "bench", "router"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["servers"] == 8
    assert "router decision" in proc.stderr


@pytest.mark.slow
def test_bench_engine_calculator_workload_and_a_workload_it_has_not():
    """`bench engine --workload calculator` prints CPU per trajectory at --n in flight; a workload the
    benchmark does not have is one clear line, not a run of another benchmark."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "fsm.cli.commands",
            "bench",
            "engine",
            "--workload",
            "calculator",
            "--n",
            "40",
            "--repeats",
            "1",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["workload"] == "calculator" and out["trajectories"] == 40 and out["cpu_us_per_trajectory"] > 0
    proc = subprocess.run(
        [sys.executable, "-m", "fsm.cli.commands", "bench", "engine", "--workload", "embedded"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    assert proc.returncode != 0 and "no --workload embedded" in proc.stderr and not proc.stdout


def test_resume_of_a_ray_run_is_refused_in_one_line(capsys, tmp_path):
    """A --ray run journals only its chunks in flight (fsm/cli/ray_run.py): --resume says why it cannot go on."""
    (tmp_path / "ray-journal").mkdir()
    for argv in (["run", "--resume", str(tmp_path)], ["run", "--resume", str(tmp_path), "--ray"]):
        line = one_line_error(capsys, argv)
        assert line.startswith(f"agentfsm: --resume {tmp_path}: a --ray run cannot be resumed"), line
