"""What tracing costs the engine: `agentfsm bench tracing`.

The engine's own CPU is the worst case for a tracer (with a real model, every call outlasts its spans by
far), so this measures trajectories per CPU second on a model-free workload, with tracing off and on, per
exporter and sampling rate. The README's benchmark table comes from here.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

from fsm.run.runtime import Runner
from fsm.telemetry import NativeExporter, OtlpHttpExporter, Telemetry

# A collector that discards (a separate process: its CPU is not the tracer's).
_RECEIVER = """
import http.server
class H(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def do_POST(self):
        self.rfile.read(int(self.headers.get("content-length") or 0))
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", "0")
        self.end_headers()
    def log_message(self, *args):
        pass
server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
print(server.server_address[1], flush=True)
server.serve_forever()
"""

# A collector that counts what arrives: POSTs decoded with the official classes; GET answers "spans traces"
# (distinct trace ids) since the last GET.
_COUNTING_RECEIVER = """
import gzip, http.server, threading
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
seen, lock = {"spans": 0, "traces": set()}, threading.Lock()
class H(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def reply(self, body):
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("content-length") or 0))
        if self.headers.get("content-encoding") == "gzip":
            body = gzip.decompress(body)
        spans = [s for rs in ExportTraceServiceRequest.FromString(body).resource_spans
                 for ss in rs.scope_spans for s in ss.spans]
        with lock:
            seen["spans"] += len(spans)
            seen["traces"].update(s.trace_id for s in spans)
        self.reply(b"")
    def do_GET(self):
        with lock:
            body = f"{seen['spans']} {len(seen['traces'])}".encode()
            seen["spans"], seen["traces"] = 0, set()
        self.reply(body)
    def log_message(self, *args):
        pass
server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
print(server.server_address[1], flush=True)
server.serve_forever()
"""

# label -> what it measures
BENCH_EXPORTERS = {
    "memory": "Telemetry(memory=True): spans kept as queued, ReadableSpans made when read",
    "null": "queued, then discarded by the export thread",
    "encode": "OTLP protobuf encoded here and gzipped, not sent",
    "otlp": "OTLP/HTTP, encoded here, gzip, POSTed to a loopback collector that discards",
    "sdk-memory": "the SDK's InMemorySpanExporter (ReadableSpans made in the export thread)",
    "sdk-otlp": "the SDK's OTLPSpanExporter (its encoder, gzip level 9, requests) to the same collector",
}
BENCH_RUNS = (("memory", 1.0), ("otlp", 1.0), ("otlp", 0.1), ("otlp", 0.01), ("otlp", 0.0))


def bench_tracing(
    n: int = 2000,
    *,
    repeats: int = 3,
    workload: str = "engine",
    runs: Sequence[tuple[str, float]] = BENCH_RUNS,
    tool_turns: int = 4,
    concurrency: int | None = None,
    show: bool = True,
) -> dict[str, Any]:
    """Trajectories per CPU second with tracing off and on: the engine's own cost, so the worst case.

    `workload` "engine" is `agentfsm bench engine`'s (tool_agent, `tool_turns` tool rounds
    against a zero-latency scripted backend, a table-lookup codec; 20 spans a trajectory at 4 rounds);
    "calculator" is specs/calculator.yaml on the tiny tokenizer (its chat template rendered per turn: a
    heavier engine, 8 spans a trajectory). Each of `runs` is (exporter, sample), exporters as in
    BENCH_EXPORTERS. Every repeat runs each of `runs` right after a run with tracing off; the CPU time is
    this process's (all threads: export included, the collector's process not), from the first trajectory
    to the end of the flush that `Runner.run` ends with; overhead is the median over repeats of on/off - 1
    of those pairs. `show` prints a table on stderr (stdout stays JSON for `agentfsm bench tracing`).
    "embedded" is `bench_tracing_embedded` (whole `agentfsm run`s with the tiny model; `n` and `runs` unused).
    """
    if workload == "embedded":
        return bench_tracing_embedded(pairs=repeats, show=show)
    make_run, spans_per_traj = _bench_workload(workload, n, tool_turns, concurrency or n)
    receiver = None
    if any(kind in ("otlp", "sdk-otlp") for kind, _ in runs):
        receiver = subprocess.Popen([sys.executable, "-c", _RECEIVER], stdout=subprocess.PIPE, text=True)
        url = f"http://127.0.0.1:{int(receiver.stdout.readline())}"

    def tracer(kind: str, sample: float) -> Telemetry:
        if kind == "memory":
            return Telemetry(otlp=False, memory=True, sample=sample)
        if kind == "otlp":
            return Telemetry(otlp=url, sample=sample)
        if kind == "null":
            return Telemetry(otlp=False, exporters=[_Discard()], sample=sample)
        if kind == "encode":
            return Telemetry(
                otlp=False,
                sample=sample,
                exporters=[
                    _EncodeOnly(
                        Resource.create({"service.name": "agentfsm"}),
                        InstrumentationScope("agentfsm"),
                        "http://127.0.0.1:9/v1/traces",
                        compression="gzip",
                    )
                ],
            )
        if kind == "sdk-memory":
            return Telemetry(otlp=False, exporters=[InMemorySpanExporter()], sample=sample)
        if kind == "sdk-otlp":
            from opentelemetry.exporter.otlp.proto.http import Compression
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            return Telemetry(
                otlp=False,
                sample=sample,
                exporters=[OTLPSpanExporter(endpoint=f"{url}/v1/traces", compression=Compression.Gzip)],
            )
        raise ValueError(f"unknown exporter {kind!r}; known: {', '.join(BENCH_EXPORTERS)}")

    def once(kind: str | None, sample: float) -> tuple[float, dict[str, Any]]:
        tel = tracer(kind, sample) if kind is not None else None
        runner, rows = make_run(tel)
        gc.collect()
        t0 = time.process_time()
        trajs = asyncio.run(runner.run(rows))  # flushes the tracer at its end
        cpu = time.process_time() - t0
        bad = [t for t in trajs if t.failed]
        assert not bad, f"{workload}: {bad[0].error}"
        stats = tel.close() if tel is not None else {}
        return cpu, stats

    try:
        runner, rows = make_run(None)  # warm up (imports, caches)
        asyncio.run(runner.run(rows[:200]))
        # Each run with tracing on right after its own run with tracing off: a run's cost depends on what
        # the runs before it left behind (heap, caches), so pairs drift together.
        off: dict[int, list[float]] = {i: [] for i in range(len(runs))}
        on: dict[int, list[float]] = {i: [] for i in range(len(runs))}
        stats: dict[int, dict[str, Any]] = {}
        for _ in range(repeats):
            for i, (kind, sample) in enumerate(runs):
                off[i].append(once(None, 0.0)[0])
                cpu, stats[i] = once(kind, sample)
                on[i].append(cpu)
    finally:
        if receiver is not None:
            receiver.terminate()
            receiver.wait()
    off_us = statistics.median(x for i in off for x in off[i]) / n * 1e6
    rows_out = []
    for i, (kind, sample) in enumerate(runs):
        cpu_us = statistics.median(on[i]) / n * 1e6
        overhead = statistics.median(b / a - 1.0 for a, b in zip(off[i], on[i]))
        spans = stats[i]["exported"] / n
        rows_out.append(
            {
                "exporter": kind,
                "sample": sample,
                "traj_per_cpu_s": round(1e6 / cpu_us, 1),
                "cpu_us_per_traj": round(cpu_us, 1),
                "overhead": round(overhead, 4),
                "spans_per_traj": round(spans, 3),
                # extra CPU per span exported (sampled-out trajectories' cost included)
                "us_per_span": round(overhead * off_us / spans, 2) if spans >= 1 else None,  # noise below
                "dropped": stats[i]["dropped"],
            }
        )
    result = {
        "workload": workload,
        "trajectories": n,
        "concurrency": concurrency or n,
        "repeats": repeats,
        "spans_per_traced_trajectory": spans_per_traj,
        "default_sample": 1.0,  # OTEL_TRACES_SAMPLER unset: the SDK's parentbased_always_on
        "off": {"traj_per_cpu_s": round(1e6 / off_us, 1), "cpu_us_per_traj": round(off_us, 1)},
        "on": rows_out,
    }
    if show:
        print(_bench_table(result), file=sys.stderr)
    return result


def bench_tracing_embedded(
    pairs: int = 3, spec: str = "specs/calculator.yaml", sample: float = 1.0, show: bool = True
) -> dict[str, Any]:
    """`agentfsm run SPEC` (the embedded tiny model) without and with `--otlp` to a loopback collector,
    alternated `pairs` times (off first in even pairs, on first in odd ones); the overhead is the median of
    the pairs' on/off - 1 (this machine's load swings a run's time tenfold); the rollout's wall time from
    each run's summary.json (`wall_s`: the rollout alone, not imports or model load; `rollout_cpu_s`, the
    process's CPU over the same window, steadier on a shared machine). The collector decodes
    every span: a traced run counts only if the spans it received equal those the run says it exported,
    none dropped, and every trajectory's trace arrived."""
    repo = Path(__file__).resolve().parent.parent
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}  # the "off" runs trace nothing
    receiver = subprocess.Popen([sys.executable, "-c", _COUNTING_RECEIVER], stdout=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{int(receiver.stdout.readline())}"
    walls: dict[str, list[float]] = {"off": [], "on": []}
    cpus: dict[str, list[float]] = {"off": [], "on": []}
    checks = []
    try:
        with tempfile.TemporaryDirectory(prefix="agentfsm-bench-") as tmp:
            for i in range(pairs):
                for mode in ("off", "on") if i % 2 == 0 else ("on", "off"):
                    out = Path(tmp) / f"{mode}{i}"
                    cmd = [sys.executable, "-m", "fsm.cli.commands", "run", spec, "--out", str(out), "-q"]
                    if mode == "on":
                        cmd += ["--otlp", url, "--trace-sample", f"{sample:g}"]
                    subprocess.run(cmd, cwd=repo, env=env, check=True, stdout=subprocess.DEVNULL)
                    summary = json.loads((out / "summary.json").read_text())
                    walls[mode].append(summary["wall_s"])
                    cpus[mode].append(summary["rollout_cpu_s"])
                    with urllib.request.urlopen(f"{url}/counts", timeout=30) as r:
                        spans, traces = map(int, r.read().split())
                    if mode == "on":
                        stats = summary["tracing"]
                        checks.append(
                            {
                                "exported": stats["exported"],
                                "dropped": stats["dropped"],
                                "received": spans,
                                "traces": traces,
                                "trajectories": summary["trajectories"],
                            }
                        )
                        complete = (
                            spans == stats["exported"]
                            and stats["dropped"] == 0
                            and traces == summary["trajectories"]
                        )
                        assert complete, f"spans lost at sample {sample:g}: {checks[-1]}"
                    else:
                        assert spans == 0, f"an untraced run sent {spans} spans"
    finally:
        receiver.terminate()
        receiver.wait()
    off, on = statistics.median(walls["off"]), statistics.median(walls["on"])
    cpu_off, cpu_on = statistics.median(cpus["off"]), statistics.median(cpus["on"])
    # each pair's two runs are neighbours in time, so they share the machine's load: their ratio is the measure
    overhead = statistics.median(b / a - 1.0 for a, b in zip(walls["off"], walls["on"]))
    cpu_overhead = statistics.median(b / a - 1.0 for a, b in zip(cpus["off"], cpus["on"]))
    result = {
        "workload": "embedded",
        "spec": spec,
        "sample": sample,
        "pairs": pairs,
        "rollout_wall_s": walls,
        "median_off_s": off,
        "median_on_s": on,
        "overhead": round(overhead, 4),
        "rollout_cpu_s": cpus,
        "median_cpu_off_s": cpu_off,
        "median_cpu_on_s": cpu_on,
        "cpu_overhead": round(cpu_overhead, 4),
        "spans": checks,
    }
    if show:
        print(
            f"agentfsm bench tracing: embedded workload ({spec}), rollout wall time (summary.json wall_s), "
            f"{pairs} pairs alternated, medians: off {off:.2f} s, OTLP at sample {sample:g} {on:.2f} s "
            f"(per pair {overhead:+.1%}); its CPU (all threads) {cpu_off:.2f} vs {cpu_on:.2f} s "
            f"(per pair {cpu_overhead:+.1%}); spans received = exported, 0 dropped, every trajectory's trace: "
            f"{checks[0]['received']} spans / {checks[0]['traces']} traces a run",
            file=sys.stderr,
        )
    return result


def _bench_workload(workload: str, n: int, tool_turns: int, concurrency: int) -> tuple[Any, int]:
    """(make_run(tracer) -> (runner, rows), spans per traced trajectory)."""
    if workload == "engine":
        from bench.engine import _workload, bench_agent

        agent = bench_agent(tool_turns)
        rows = [{"raw_prompt": [{"role": "user", "content": "hi"}]} for _ in range(n)]

        def make_run(tel: Telemetry | None) -> tuple[Runner, list]:
            codec, backend = _workload(tool_turns)
            return Runner(agent, backend, codec, max_concurrency=concurrency, tracer=tel), rows

        return make_run, 1 + (2 + 2 * tool_turns) + (tool_turns + 1) + tool_turns
    if workload != "calculator":
        raise ValueError(f"unknown workload {workload!r}: engine | calculator")
    from bench.engine import calculator_workload

    return calculator_workload(n, concurrency), 8


def _bench_table(r: dict[str, Any]) -> str:
    lines = [
        f"agentfsm bench tracing: {r['workload']} workload, {r['trajectories']} trajectories "
        f"({r['spans_per_traced_trajectory']} spans each when traced), CPU time of this process (export thread "
        f"included), median of {r['repeats']} runs, each right after a run with tracing off",
        f"{'tracing':<9} {'sample':>6} {'traj/CPU-s':>11} {'CPU µs/traj':>12} {'overhead':>9} {'µs/span':>8} "
        f"{'spans/traj':>10} {'dropped':>8}",
        f"{'off':<9} {'-':>6} {r['off']['traj_per_cpu_s']:>11.0f} {r['off']['cpu_us_per_traj']:>12.1f} {'-':>9} "
        f"{'-':>8} {0:>10} {'-':>8}",
    ]
    for row in r["on"]:
        sample = f"{row['sample']:g}" + ("*" if row["sample"] == r["default_sample"] else "")
        per_span = "-" if row["us_per_span"] is None else f"{row['us_per_span']:.2f}"
        lines.append(
            f"{row['exporter']:<9} {sample:>6} {row['traj_per_cpu_s']:>11.0f} {row['cpu_us_per_traj']:>12.1f} "
            f"{row['overhead']:>+9.1%} {per_span:>8} {row['spans_per_traj']:>10.2f} {row['dropped']:>8}"
        )
    lines.append(
        f"* the default sampling (OTEL_TRACES_SAMPLER unset: {r['default_sample']:g}). Exporters: "
        + "; ".join(f"{k}: {BENCH_EXPORTERS[k]}" for k in dict.fromkeys(x["exporter"] for x in r["on"]))
    )
    return "\n".join(lines)


class _Discard(NativeExporter):
    def export_spans(self, items: Sequence[Any]) -> bool:
        return True


class _EncodeOnly(OtlpHttpExporter):
    def send(self, data: bytes) -> bool:
        return True


if __name__ == "__main__":  # python -m bench.tracing [n] [workload] [exporter:sample ...]
    args = sys.argv[1:]
    chosen = tuple((a.split(":")[0], float(a.split(":")[1])) for a in args[2:]) or BENCH_RUNS
    out = bench_tracing(
        int(args[0]) if args else 2000, workload=args[1] if len(args) > 1 else "engine", runs=chosen
    )
    print(json.dumps(out, indent=1))
