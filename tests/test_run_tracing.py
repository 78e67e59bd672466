"""`agentfsm run` with tracing, as a user runs it: the real CLI process exporting to a real OTLP/HTTP receiver
(tests/test_telemetry.py's, decoding ExportTraceServiceRequest with the official classes).

Every span the run ends arrives, or is counted as dropped with a warning naming the endpoint; a run shorter
than the export delay loses nothing (the run's owner closes its tracer), and `--trace console` keeps span
JSON off stdout, where the run table goes.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from tests.test_telemetry import Receiver

REPO = Path(__file__).resolve().parents[1]


def run_cli(
    *args: str, env: dict[str, str] | None = None, timeout: float = 420
) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    environ.update(PYTHONPATH=str(REPO), **(env or {}))
    return subprocess.run(
        [sys.executable, "-m", "fsm.cli.commands", "run", *args],
        cwd=REPO,
        env=environ,
        text=True,
        capture_output=True,
        timeout=timeout,
    )


def expected(out: Path) -> Counter:
    """Spans per kind that the run's trajectories should have produced, from trajectories.jsonl."""
    want: Counter = Counter()
    for line in (out / "trajectories.jsonl").read_text().splitlines():
        t = json.loads(line)
        path = t["state_path"]
        want["root"] += 1
        want["transition"] += len(path) - 1
        want["model"] += sum(s == "GENERATING" for s in path[:-1])
        want["tool"] += sum(
            seg["text"].count("<tool_call>") for seg in t["turns"] if seg["role"] == "assistant"
        )
    return want


def kind(span: dict) -> str:
    name = span["name"]
    if name.startswith("invoke_agent"):
        return "root"
    if name.startswith("text_completion"):
        return "model"
    if name.startswith("execute_tool"):
        return "tool"
    assert " -> " in name, name
    return "transition"


@pytest.mark.slow
@pytest.mark.parametrize(
    "delay_ms, prompts",
    [(600_000, 2), (200, 4)],
    ids=["shorter-than-the-export-delay", "longer-than-the-export-delay"],
)
def test_every_span_of_a_cli_run_reaches_the_collector(tmp_path, delay_ms, prompts):
    with Receiver() as receiver:
        done = run_cli(
            "specs/calculator.yaml",
            "--num-prompts",
            str(prompts),
            "--otlp",
            receiver.url,
            "--out",
            str(tmp_path),
            "-q",
            env={"OTEL_BSP_SCHEDULE_DELAY": str(delay_ms)},
        )
        assert done.returncode == 0, done.stderr[-2000:]
        got = Counter(kind(s) for s in receiver.spans)
    want = expected(tmp_path)
    assert want["root"] == prompts and want["tool"] >= 1
    assert got == want
    tracing = json.loads((tmp_path / "summary.json").read_text())["tracing"]
    assert tracing["ended"] == tracing["exported"] == sum(want.values()) and tracing["dropped"] == 0


@pytest.mark.slow
def test_collector_down_counts_every_span_as_dropped_and_names_it(tmp_path):
    with Receiver() as receiver:  # a port that was a collector's a moment ago: nothing listens there now
        url = receiver.url
    done = run_cli(
        "specs/calculator.yaml",
        "--num-prompts",
        "2",
        "--otlp",
        url,
        "--out",
        str(tmp_path),
        env={"OTEL_EXPORTER_OTLP_TIMEOUT": "2"},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    tracing = json.loads((tmp_path / "summary.json").read_text())["tracing"]
    assert tracing["ended"] == sum(expected(tmp_path).values()) > 0
    assert tracing["exported"] == 0 and tracing["dropped"] == tracing["ended"]
    assert f"{url}/v1/traces" in done.stderr
    assert re.search(rf"spans exported / dropped\s*│\s*0 / {tracing['ended']}\s*│", done.stdout)


@pytest.mark.slow
def test_console_spans_go_to_stderr_never_among_the_table(tmp_path):
    done = run_cli(
        "specs/calculator.yaml", "--num-prompts", "1", "--trace", "console", "--out", str(tmp_path)
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert '"trace_id"' not in done.stdout and "spans exported / dropped" in done.stdout
    tracing = json.loads((tmp_path / "summary.json").read_text())["tracing"]
    assert (
        done.stderr.count('"trace_id"')
        == tracing["ended"]
        == tracing["exported"]
        == sum(expected(tmp_path).values())
    )


@pytest.mark.slow
def test_an_otlp_endpoint_without_a_scheme_is_http(tmp_path):
    """`--otlp localhost:4318` (issue 46 §4 ended in a traceback after the model loaded): http://, as the SDK
    reads OTEL_EXPORTER_OTLP_ENDPOINT."""
    with Receiver() as receiver:
        bare = receiver.url.removeprefix("http://")
        done = run_cli(
            "specs/calculator.yaml", "--num-prompts", "1", "--otlp", bare, "--out", str(tmp_path), "-q"
        )
        assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-2000:]
        got = Counter(kind(s) for s in receiver.spans)
    assert got == expected(tmp_path) and got["root"] == 1


@pytest.mark.parametrize(
    "flags, env",
    [
        (["--otlp", "ftp://collector:4318"], {}),
        (["--otlp", "localhost:port"], {}),
        ([], {"OTEL_EXPORTER_OTLP_ENDPOINT": "grpc://collector:4317"}),
    ],
)
def test_an_endpoint_that_is_no_http_url_is_refused_before_the_model_loads(tmp_path, flags, env):
    done = run_cli("specs/calculator.yaml", "--num-prompts", "1", *flags, "--out", str(tmp_path), env=env)
    assert done.returncode in (1, 2) and "Traceback" not in done.stderr, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "expected http(s)://host[:port]" in lines[0], lines
    assert not (tmp_path / "summary.json").exists()
