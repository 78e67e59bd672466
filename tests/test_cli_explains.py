"""A run that fails says why, through the CLI as a user meets it: a harness's failure is in the row's record and
in `agentfsm show`, a run whose rows all fail for one cause names it on stderr in one line and exits 1, and a
`--check-tokens` difference names its row, segment, position and the text there (record, show, stderr)."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys

import pytest
from rich.console import Console

from backends.scripted import echo_backend
from fsm.cli.commands import main
from fsm.output.rundir import print_summary
from tests.conftest import REPO, model_turn, scripted
from tests.test_cli import _ThreadServer, run_argv

ENV = {**os.environ, "PYTHONPATH": str(REPO)}


def _records(out) -> list[dict]:
    return [json.loads(line) for line in (out / "trajectories.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_the_readme_gateway_example_without_the_extra_says_why(tmp_path):
    """The README's `agentfsm gateway examples/gateway/base.yaml` where the openai SDK is not installed (a
    package that cannot be imported stands first on the path, as in a fresh `.[test]` virtualenv)."""
    missing = tmp_path / "no_extras" / "openai"
    missing.mkdir(parents=True)
    (missing / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'openai'\", name='openai')\n"
    )
    env = {**ENV, "PYTHONPATH": f"{missing.parent}{os.pathsep}{REPO}"}
    out = tmp_path / "gw"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "fsm.cli",
            "gateway",
            "examples/gateway/base.yaml",
            "--num-prompts",
            "2",
            "--out",
            str(out),
            "-q",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    (line,) = proc.stderr.splitlines()
    assert line == (
        f"agentfsm: all 2 rows failed, all for one cause: harness_failed: error: ModuleNotFoundError: "
        f"No module named 'openai' (the harness needs the gateway extra: pip install 'agentfsm[gateway]'); "
        f"see agentfsm show {out} --failed"
    ), line
    summary = json.loads((out / "summary.json").read_text())
    table = io.StringIO()
    print_summary(summary, Console(file=table, width=100))
    assert summary["failed"] == 2 and re.search(r"failed rows\s*│\s*2\s*│", table.getvalue()), (
        table.getvalue()
    )
    for record in _records(out):  # the outputs are written all the same, each row with its harness's outcome
        assert record["termination_reason"] == "harness_failed"
        assert record["harness"]["outcome"] == "error"
        assert record["harness"]["error"] == "ModuleNotFoundError: No module named 'openai'"
    shown = subprocess.run(
        [sys.executable, "-m", "fsm.cli", "show", str(out), "--failed"],
        cwd=REPO,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.count("harness: error: ModuleNotFoundError: No module named 'openai'") == 2, (
        shown.stdout
    )


@pytest.mark.slow
def test_every_row_failing_with_max_error_rate_1_is_a_warning(tmp_path, capsys, tok):
    server = _ThreadServer(scripted(lambda row, sample, turn, prompt: [999_999]))  # ids past the vocabulary
    try:
        code = main(
            run_argv(
                server.url,
                tmp_path / "out",
                "--num-prompts",
                "2",
                "-q",
                "--max-error-rate",
                "1",
                "--retry-window",
                "1",
            )
        )
    finally:
        server.close()
    err = capsys.readouterr().err
    assert code == 0, err
    (line,) = err.splitlines()
    assert (
        line.startswith("agentfsm: warning: all 2 rows failed, all for one cause: ") and "--failed" in line
    ), line


def test_a_token_check_difference_names_its_row_position_and_text(tmp_path, capsys, tok):
    # the model writes its call's JSON without spaces; the template re-renders it with them
    compact = '<tool_call>\n{"name":"calculator","arguments":{"expression":"1+2"}}\n</tool_call>'

    def script(row, sample, turn, prompt):
        if row != 1:
            return model_turn(tok, "#### 3")
        return model_turn(tok, compact) if turn == 0 else model_turn(tok, "#### 3")

    server = _ThreadServer(scripted(script))
    out = tmp_path / "out"
    try:
        code = main(run_argv(server.url, out, "--num-prompts", "2", "-q", "--check-tokens"))
    finally:
        server.close()
    err = capsys.readouterr().err
    assert code == 0, err
    records = _records(out)
    assert "token_check" not in records[0]
    check = records[1]["token_check"]  # the first differing position and the text on both sides of it
    assert check.startswith("token ") and 'trajectory has \'"calculator","arguments":{' in check, check
    assert 'a re-render has \' "calculator", "arguments": {' in check, check
    (line,) = err.splitlines()
    assert line == (
        f"agentfsm: warning: --check-tokens: 1 row differs from a re-render of their messages; row 1 "
        f"(sample 0): {check}; see agentfsm show {out} --failed"
    ), line
    assert json.loads((out / "summary.json").read_text())["token_check_failures"] == 1
    assert main(["show", str(out), "--failed"]) == 0
    shown = capsys.readouterr().out
    assert shown.count("=== trajectory") == 1 and f"token check: {check}" in shown, shown


# --- the small ones (issue 35.12) --------------------------------------------------------------------------


def test_render_refuses_another_specs_run_and_warns_about_an_edited_one(capsys, tmp_path):
    from tests.test_cli import one_line_error

    calculator = REPO / "specs" / "calculator.yaml"
    run = tmp_path / "run"
    run.mkdir()
    (run / "summary.json").write_text(
        json.dumps(
            {
                "spec": str(REPO / "specs" / "tool_agent.yaml"),
                "spec_hash": "0" * 64,
                "fsm": {"edges": {}, "states": {}},
            }
        )
    )
    line = one_line_error(
        capsys, ["render", str(calculator), "--run", str(run), "-o", str(tmp_path / "a.dot")]
    )
    assert line == (
        f"agentfsm: --run {run}: that run is of another spec ({REPO / 'specs' / 'tool_agent.yaml'}), "
        f"not {calculator}; render the run with its own spec"
    ), line
    assert not (tmp_path / "a.dot").exists()
    (run / "summary.json").write_text(
        json.dumps({"spec": str(calculator), "spec_hash": "0" * 64, "fsm": {"edges": {}, "states": {}}})
    )
    main(["render", str(calculator), "--run", str(run), "-o", str(tmp_path / "b.dot")])
    err = capsys.readouterr().err
    assert err.startswith(
        f"agentfsm: warning: --run {run}: {calculator} changed since that run (spec hash 000000000000, now "
    ), err


def test_a_spec_anywhere_extends_a_shipped_spec_by_name(tmp_path):
    (tmp_path / "mine.yaml").write_text("name: mine\nextends: calculator\nlimits: {max_assistant_turns: 3}\n")
    (tmp_path / "typo.yaml").write_text("name: typo\nextends: calculater.yaml\n")
    ok = subprocess.run(
        [sys.executable, "-m", "fsm.cli", "validate", "mine.yaml", "typo.yaml"],
        cwd=tmp_path,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ok.returncode == 2, ok.stdout + ok.stderr
    mine, typo = ok.stdout.splitlines()
    assert mine == "mine.yaml: ok"
    assert typo == (
        "typo.yaml:2:10: extends: base spec 'calculater.yaml' not found (looked for calculater.yaml, "
        f"{REPO / 'specs' / 'calculater.yaml'}; the shipped specs are named by file, e.g. extends: "
        "tool_agent.yaml)"
    ), typo


def test_a_server_without_a_scheme_gets_the_url_that_works(capsys):
    from tests.test_cli import one_line_error

    line = one_line_error(
        capsys, ["run", str(REPO / "specs" / "calculator.yaml"), "--server", "localhost:30000"]
    )
    assert (
        "argument --server: 'localhost:30000' is not a URL; did you mean http://localhost:30000?" in line
    ), line


def test_dev_server_on_a_port_in_use_fails_before_loading_the_model(capsys, monkeypatch):
    import socket

    import backends.devserver
    from tests.test_cli import one_line_error

    def load_nothing(args):
        raise AssertionError("the model was loaded before the port was checked")

    monkeypatch.setattr(backends.devserver, "serve", load_nothing)
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        line = one_line_error(capsys, ["dev-server", "--host", "127.0.0.1", "--port", str(port)])
    assert (
        line.startswith(f"agentfsm: --port {port}: cannot serve on 127.0.0.1:{port} (")
        and "another --port" in line
    )


def test_a_bad_row_is_named_by_its_uid_and_its_data_file_line(tmp_path, capsys):
    """Every message about a row names it one way: its uid (else its number) and the data file's line."""
    data = tmp_path / "rows.jsonl"
    good = {
        "raw_prompt": [{"role": "user", "content": "What is 1 + 2?"}],
        "reward_model": {"ground_truth": "3"},
    }
    lines = [
        json.dumps({**good, "uid": "a"}),
        "",
        json.dumps({**good, "uid": "q7", "tools_kwargs": "abc"}),
        json.dumps({**good, "raw_prompt": [{"role": "usr", "content": "hi"}]}),
    ]
    data.write_text("\n".join(lines) + "\n")
    out = tmp_path / "run"
    server = _ThreadServer(echo_backend())
    try:
        code = main(run_argv(server.url, out, "--data", str(data), "-q", "--max-error-rate", "1"))
    finally:
        server.close()
    assert code == 0
    records = [json.loads(line) for line in (out / "trajectories.jsonl").read_text().splitlines()]
    reasons = [r["termination_reason"] for r in records]
    assert reasons[1].startswith(f"error: bad row q7 ({data}:3): 'tools_kwargs'"), reasons[1]
    assert reasons[2].startswith(f"error: bad row 2 ({data}:4): 'raw_prompt[0].role'"), reasons[2]
