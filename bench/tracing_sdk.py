"""The OpenTelemetry SDK's own export path against agentfsm's: `python -m bench.tracing_sdk`.

fsm/telemetry keeps cheap spans on the event loop (spans.py) and, for OTLP, its own encoder and HTTP sender
(wire.py, export.py). This measures, alternated in one process (A/B/A/B, the order rotated every round),
what each export path costs on the same spans:

- "ours": `Telemetry(otlp=URL)`: the tracer's queue and thread, the hand-written encoder, http.client;
- "sdk-exporter": the same queue and thread, then the SDK's OTLPSpanExporter (ReadableSpans made in the
  export thread, the SDK's protobuf encoder, requests, its retries and OTEL_EXPORTER_OTLP_* settings);
- "sdk-bsp": the SDK all the way from the span's end: a ReadableSpan made when the span ends, handed to the
  SDK's BatchSpanProcessor, exported by its OTLPSpanExporter;
- "off": no tracer.

Workloads: `engine` and `calculator` as in bench/tracing.py (no model latency: the engine's CPU is the worst
case), `calculator-latency` (the same calculator conversation, every model turn taking `latency_ms`, as a
real model's turns do), and `cli` (the main job: `agentfsm run specs/calculator.yaml --otlp URL` with the
embedded tiny model, one process per run; wall and CPU of the rollout from its summary.json). The collector
runs in its own process and decodes every request, so a traced run counts only if every span arrived.
"""

from __future__ import annotations

import asyncio
import gc
import json
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

from bench.tracing import _COUNTING_RECEIVER, _bench_workload
from fsm.telemetry import NativeExporter, Telemetry
from fsm.telemetry.spans import _readable

PATHS = ("off", "ours", "sdk-exporter", "sdk-bsp")
REPO = Path(__file__).resolve().parent.parent


class _Counted(SpanExporter):
    """The SDK's OTLPSpanExporter, counting the spans it accepted (the SDK's processor counts nothing)."""

    def __init__(self, exporter: SpanExporter):
        self.exporter, self.exported, self.failed = exporter, 0, 0

    def export(self, spans: Any) -> SpanExportResult:
        result = self.exporter.export(spans)
        if result is SpanExportResult.SUCCESS:
            self.exported += len(spans)
        else:
            self.failed += len(spans)
        return result

    def shutdown(self) -> None:
        self.exporter.shutdown()


class _InOurQueue(NativeExporter):
    """An SDK exporter behind the tracer's own queue and thread: ReadableSpans made in the export thread."""

    def __init__(self, exporter: SpanExporter):
        self.exporter, self.resource, self.scope = exporter, None, None

    def export_spans(self, items: Any) -> bool:
        spans = [_readable(item, self.resource, self.scope) for item in items]
        return self.exporter.export(spans) is SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        self.exporter.shutdown()


def _sdk_exporter(url: str) -> _Counted:
    from opentelemetry.exporter.otlp.proto.http import Compression
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return _Counted(OTLPSpanExporter(endpoint=f"{url}/v1/traces", compression=Compression.Gzip))


def tracer(path: str, url: str) -> Any:
    """A tracer exporting to `url` by `path` (one of PATHS); None for "off"."""
    if path == "off":
        return None
    if path == "ours":
        return Telemetry(otlp=url)
    if path == "sdk-exporter":
        exporter = _sdk_exporter(url)
        ours = _InOurQueue(exporter)
        tel = Telemetry(otlp=False, exporters=[ours])
        ours.resource, ours.scope = tel.resource, tel.scope
        tel._sdk_exporter = exporter
        return tel
    if path != "sdk-bsp":
        raise ValueError(f"unknown path {path!r}: {' | '.join(PATHS)}")
    tel = Telemetry(otlp=False)  # no pipeline of its own: every ended span goes to the SDK's processor
    exporter = _sdk_exporter(url)
    # the queue and batch sizes ours runs with (the SDK's defaults, 2048 and 512, drop spans in these bursts)
    bsp = BatchSpanProcessor(exporter, max_queue_size=16384, max_export_batch_size=2048)
    tel.provider.add_span_processor(bsp)
    resource, scope, on_end = tel.resource, tel.scope, bsp.on_end
    tel._emit = lambda item: on_end(_readable(item, resource, scope))
    tel._sdk_exporter = exporter
    return tel


def _exported(tel: Any) -> int:
    exporter = getattr(tel, "_sdk_exporter", None)
    return exporter.exported if exporter is not None else tel.stats()["exported"]


def _received(url: str) -> tuple[int, int]:
    with urllib.request.urlopen(f"{url}/counts", timeout=60) as r:
        spans, traces = map(int, r.read().split())
    return spans, traces


def _in_process(workload: str, n: int, latency_ms: float, concurrency: int) -> tuple[Any, int]:
    if workload != "calculator-latency":
        return _bench_workload(workload, n, 4, concurrency)
    from transformers import AutoTokenizer

    from backends.base import BaseBackend, GenerateResult
    from bench.engine import _calculator_replies
    from fsm.run.compile import compile_spec
    from fsm.run.runtime import Runner
    from specs.calculator import make_prompts

    tok = AutoTokenizer.from_pretrained(str(REPO / "backends/tiny/assets"))
    agent = compile_spec(REPO / "specs/calculator.yaml")
    call, answer = _calculator_replies(tok)

    class Slow(BaseBackend):  # a model whose every turn takes latency_ms, as a real one's do
        provider, model_name = "scripted", "replay"

        async def generate(self, request: Any) -> GenerateResult:
            await asyncio.sleep(latency_ms / 1e3)
            ids = call if request.rid.endswith("_t00") else answer
            return GenerateResult(
                list(ids), [-0.5] * len(ids), "stop", len(request.prompt_ids), 0, server="replay"
            )

    rows = make_prompts(n)
    return (lambda tel: (Runner(agent, Slow(), tok, max_concurrency=concurrency, tracer=tel), rows)), 8


def bench(
    workload: str = "calculator",
    n: int = 2000,
    rounds: int = 5,
    latency_ms: float = 30.0,
    concurrency: int | None = None,
    paths: tuple[str, ...] = PATHS,
) -> dict[str, Any]:
    """Per path: the rollout's wall and CPU time (this process, export threads included) over `rounds`
    alternated rounds, medians and ranges; the spans the collector received must be those the exporter
    says it exported, and the spans that never arrived (a full queue behind a slow exporter) are counted."""
    receiver = subprocess.Popen([sys.executable, "-c", _COUNTING_RECEIVER], stdout=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{int(receiver.stdout.readline())}"
    wall: dict[str, list[float]] = {p: [] for p in paths}
    cpu: dict[str, list[float]] = {p: [] for p in paths}
    spans: dict[str, int] = {}
    lost: dict[str, list[int]] = {
        p: [] for p in paths if p != "off"
    }  # trajectories whose trace is incomplete
    try:
        if workload == "cli":
            _cli_rounds(url, rounds, paths, wall, cpu, spans)
        else:
            make_run, per_traj = _in_process(workload, n, latency_ms, concurrency or n)
            runner, rows = make_run(None)
            asyncio.run(runner.run(rows[:200]))  # warm up
            for r in range(rounds):
                for path in (
                    paths[r % len(paths) :] + paths[: r % len(paths)]
                ):  # rotated: no path always first
                    tel = tracer(path, url)
                    runner, rows = make_run(tel)
                    gc.collect()
                    t0, c0 = time.perf_counter(), time.process_time()
                    trajs = asyncio.run(runner.run(rows))  # ends with the tracer's flush
                    wall[path].append(time.perf_counter() - t0)
                    cpu[path].append(time.process_time() - c0)
                    assert not any(t.failed for t in trajs)
                    if tel is not None:
                        exported = _exported(tel)
                        tel.close()
                        got, traces = _received(url)
                        assert got == exported, (path, got, exported)  # whatever was lost, was counted
                        spans[path] = got
                        lost[path].append(len(rows) * per_traj - got)
                    else:
                        assert _received(url)[0] == 0
    finally:
        receiver.terminate()
        receiver.wait()
    per = n if workload != "cli" else 1
    out = {
        "workload": workload,
        "trajectories": n if workload != "cli" else 64,
        "rounds": rounds,
        "latency_ms": latency_ms if workload == "calculator-latency" else 0,
        "spans_per_run": spans,
        "spans_dropped": lost,
    }
    for name, series in (("wall", wall), ("cpu", cpu)):
        unit = 1e6 / per if per > 1 else 1.0  # µs per trajectory in process, s per run for the CLI
        out[name] = {
            p: {
                "median": round(statistics.median(v) * unit, 2),
                "min": round(min(v) * unit, 2),
                "max": round(max(v) * unit, 2),
            }
            for p, v in series.items()
        }
    return out


_CLI = """
import sys
import fsm.cli.commands as c
import bench.tracing_sdk as b
path, url = sys.argv[1], sys.argv[2]
c._tracer = lambda args: b.tracer(path, url)
sys.exit(c.main(sys.argv[3:]))
"""


def _cli_rounds(url: str, rounds: int, paths: tuple[str, ...], wall: dict, cpu: dict, spans: dict) -> None:
    """The main job, once per path per round, each its own process (the tracer chosen by path)."""
    with tempfile.TemporaryDirectory(prefix="agentfsm-bench-") as tmp:
        for r in range(rounds):
            for path in paths[r % len(paths) :] + paths[: r % len(paths)]:
                out = Path(tmp) / f"{path}{r}"
                cmd = [
                    sys.executable,
                    "-c",
                    _CLI,
                    path,
                    url,
                    "run",
                    "specs/calculator.yaml",
                    "--out",
                    str(out),
                    "-q",
                ]
                subprocess.run(cmd, cwd=REPO, check=True, stdout=subprocess.DEVNULL)
                summary = json.loads((out / "summary.json").read_text())
                wall[path].append(summary["wall_s"])
                cpu[path].append(summary["rollout_cpu_s"])
                got, traces = _received(url)
                if path != "off":
                    assert traces == summary["trajectories"] and got > 0, (path, got, traces)
                    spans[path] = got


if __name__ == "__main__":  # python -m bench.tracing_sdk WORKLOAD [n] [rounds] [latency_ms] [concurrency]
    a = sys.argv[1:]
    result = bench(
        a[0] if a else "calculator",
        int(a[1]) if len(a) > 1 else 2000,
        int(a[2]) if len(a) > 2 else 5,
        float(a[3]) if len(a) > 3 else 30.0,
        int(a[4]) if len(a) > 4 else None,
    )
    print(json.dumps(result, indent=1))
