"""Tracing against a real OTLP/HTTP receiver on loopback: one trace per trajectory, the span tree, GenAI
attributes, error spans, whole-trajectory sampling, counted drops, and nothing at all when tracing is off.

The receiver is an aiohttp app in a background thread decoding `ExportTraceServiceRequest` protobufs with the
official classes; the exporter is ours (hand-encoded protobuf, gzip, the SDK's retry rules, headers from the
OTEL_* variables), and its bytes are checked against the SDK's own encoder, span for span.
"""

from __future__ import annotations

import asyncio
import gzip
import logging
import threading
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from opentelemetry import trace as otel_trace
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from transformers import AutoTokenizer

import fsm
from backends.base import BackendUnavailable
from backends.scripted import ScriptedBackend
from fsm import telemetry as T
from fsm.telemetry import Telemetry
from fsm.telemetry import export as tel_export
from fsm.telemetry import shapes as tel_shapes
from fsm.telemetry import spans as tel_spans
from specs.calculator import make_prompts

REPO = Path(__file__).resolve().parents[1]


# --- an OTLP/HTTP receiver --------------------------------------------------------------------------------


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return tuple(_value(x) for x in v.array_value.values)
    return getattr(v, kind) if kind else None


class Receiver:
    """POST /v1/traces on 127.0.0.1 in its own thread and loop. `gate` cleared = hold every request;
    `responses` = (status, headers) to answer the next requests with (then 200); spans are kept on 200 only."""

    def __init__(self) -> None:
        self.spans: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self.responses: list[tuple[int, dict[str, str]]] = []
        self.gate = threading.Event()
        self.gate.set()
        self.first_request = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="otlp-receiver", daemon=True)

    def __enter__(self) -> Receiver:
        self._thread.start()
        assert self._ready.wait(10), "receiver did not start"
        return self

    def __exit__(self, *exc: Any) -> None:
        self.gate.set()
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _traces(self, request: web.Request) -> web.Response:
        body = await request.read()
        if body[:2] == b"\x1f\x8b":  # gzip (aiohttp may already have decoded it)
            body = gzip.decompress(body)
        message = ExportTraceServiceRequest()
        message.ParseFromString(body)
        self.headers.append(dict(request.headers))
        self.first_request.set()
        while not self.gate.is_set():
            await asyncio.sleep(0.01)
        if self.responses:
            status, headers = self.responses.pop(0)
            return web.Response(status=status, headers=headers)
        for rs in message.resource_spans:
            resource = {a.key: _value(a.value) for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    self.spans.append(
                        {
                            "name": s.name,
                            "trace_id": s.trace_id.hex(),
                            "span_id": s.span_id.hex(),
                            "parent": s.parent_span_id.hex() or None,
                            "kind": s.kind,
                            "start": s.start_time_unix_nano,
                            "end": s.end_time_unix_nano,
                            "status": s.status.code,
                            "status_message": s.status.message,
                            "attrs": {a.key: _value(a.value) for a in s.attributes},
                            "resource": resource,
                            "scope": ss.scope.name,
                            "events": [e.name for e in s.events],
                        }
                    )
        return web.Response(
            body=ExportTraceServiceResponse().SerializeToString(), content_type="application/x-protobuf"
        )

    def _serve(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._loop.run_until_complete(self._main())

    async def _main(self) -> None:
        self._stop = asyncio.Event()
        app = web.Application(client_max_size=64 * 2**20)
        app.router.add_post("/v1/traces", self._traces)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]
        self._ready.set()
        await self._stop.wait()
        await runner.cleanup()


@pytest.fixture
def receiver():
    with Receiver() as r:
        yield r


@pytest.fixture(autouse=True)
def _no_ambient_otel_env(monkeypatch):
    for name in (
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
        "OTEL_SERVICE_NAME",
        "OTEL_TRACES_SAMPLER",
        "OTEL_TRACES_SAMPLER_ARG",
        "OTEL_SDK_DISABLED",
        "OTEL_TRACES_EXPORTER",
        "OTEL_EXPORTER_OTLP_HEADERS",
        "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT",
        "OTEL_BSP_MAX_QUEUE_SIZE",
    ):
        monkeypatch.delenv(name, raising=False)


# --- the workload: specs/calculator.yaml, the tiny tokenizer, a scripted model -----------------------------


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(REPO / "backends/tiny/assets")


@pytest.fixture(scope="module")
def agent():
    return fsm.compile_spec(REPO / "specs/calculator.yaml")


def _row_of(session_id: str) -> int:
    return int(session_id.rsplit("-", 2)[1])


def calculator_model(tokenizer, *, fail_rows=(), dead_rows=(), on_call=None, **kwargs) -> ScriptedBackend:
    """Turn 0 calls the calculator ("1 / 0" on `fail_rows`: the tool raises), turn 1 answers;
    `dead_rows` have no model at all (the backend raises)."""

    def ids(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]

    def turn(session_id: str, k: int, prompt: list[int]) -> list[int]:
        row = _row_of(session_id)
        if on_call is not None:
            on_call(session_id)
        if row in dead_rows:
            raise BackendUnavailable(f"no server for row {row}")
        if k == 0:
            expr = "1 / 0" if row in fail_rows else "1 + 2"
            return ids(
                f'<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{expr}"}}}}\n</tool_call>'
            )
        return ids("The answer is 3.\n#### 3")

    return ScriptedBackend(turn, **kwargs)


def expected_spans(traj) -> int:
    """Root + one per transition + one per model call + one per tool call."""
    calls = sum(1 for s in traj.path[:-1] if s == "GENERATING")
    tools = sum(1 for s in traj.path[:-1] if s == "PROCESSING_TOOLS")
    return 1 + len(traj.path) - 1 + calls + tools


def by_trace(spans: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for s in spans:
        out[s["trace_id"]].append(s)
    return out


# --- tests --------------------------------------------------------------------------------------------------


async def test_otlp_receiver_gets_one_trace_per_trajectory(receiver, tokenizer, agent, monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.url)  # the standard way: + /v1/traces
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", "x-team=rl,x-token=abc")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "agentfsm-test")
    tel = Telemetry.from_env()
    assert tel is not None and tel.otlp_endpoint == f"{receiver.url}/v1/traces"
    rows = make_prompts(3)
    backend = calculator_model(tokenizer, fail_rows={1}, latency_s=0.002)
    with tel:
        trajs = await fsm.Runner(agent, backend, tokenizer, tracer=tel).run(rows, n=2)
        stats = tel.stats()  # Runner.run flushed
    assert stats["exported"] == len(receiver.spans) == sum(map(expected_spans, trajs))
    assert stats["dropped"] == 0 and stats["trajectories"] == 6
    assert receiver.headers[0]["x-team"] == "rl" and receiver.headers[0]["x-token"] == "abc"

    traces = by_trace(receiver.spans)
    assert len(traces) == len(trajs) == 6  # one trace per trajectory, distinct ids
    roots = {}
    for spans in traces.values():
        (root,) = [s for s in spans if s["parent"] is None]
        roots[root["attrs"]["gen_ai.conversation.id"]] = (root, spans)
    assert set(roots) == {t.session_id for t in trajs}

    for traj in trajs:
        root, spans = roots[traj.session_id]
        ra = root["attrs"]
        assert root["name"] == "invoke_agent calculator" and root["kind"] == 1  # INTERNAL
        assert root["resource"]["service.name"] == "agentfsm-test" and root["scope"] == "agentfsm"
        assert ra["openinference.span.kind"] == "AGENT"  # what Phoenix classifies spans by
        assert ra["gen_ai.operation.name"] == "invoke_agent" and ra["gen_ai.agent.name"] == "calculator"
        assert ra["gen_ai.provider.name"] == "scripted" and ra["agentfsm.agent.hash"] == agent.hash
        assert (ra["agentfsm.index"], ra["agentfsm.uid"], ra["agentfsm.sample"]) == (
            traj.index,
            traj.uid,
            traj.sample,
        )
        assert ra["agentfsm.reward_score"] == traj.reward_score
        assert ra["fsm.termination_reason"] == traj.termination_reason == "done"
        assert ra["fsm.turns"] == traj.num_turns and ra["fsm.transitions"] == len(traj.path) - 1
        assert ra["agentfsm.tokens.prompt"] == len(traj.prompt_ids)
        assert ra["agentfsm.tokens.response"] == len(traj.response_ids)
        assert ra["gen_ai.usage.output_tokens"] == traj.response_mask.count(1)
        assert root["status"] == 0  # UNSET

        # the tree: root -> transition spans (in the trajectory's order) -> model / tool calls
        children = defaultdict(list)
        for s in spans:
            children[s["parent"]].append(s)
        steps = sorted(children[root["span_id"]], key=lambda s: s["start"])
        assert [s["name"] for s in steps] == [f"{a} -> {b}" for a, b in zip(traj.path, traj.path[1:])]
        assert [s["attrs"]["fsm.edge"] for s in steps] == traj.transitions_fired
        model_total = obs_total = 0
        for step in steps:
            a = step["attrs"]
            assert a["openinference.span.kind"] == "CHAIN"
            edge = agent.edges[a["fsm.edge"]]
            assert (a["fsm.source"], a["fsm.dest"], a["fsm.guard"]) == (edge.source, edge.dest, edge.label)
            assert a.get("fsm.reason") == edge.reason
            assert root["start"] <= step["start"] <= step["end"] <= root["end"]
            model_total += a["fsm.tokens.model"]
            obs_total += a["fsm.tokens.observation"]
            kids = children[step["span_id"]]
            if a["fsm.source"] == "GENERATING":
                (call,) = kids
                c = call["attrs"]
                assert call["name"] == "text_completion scripted" and call["kind"] == 3  # CLIENT
                assert c["gen_ai.operation.name"] == "text_completion"
                assert c["gen_ai.request.model"] == "scripted" and c["gen_ai.provider.name"] == "scripted"
                assert c["gen_ai.request.max_tokens"] == 64 and c["gen_ai.request.temperature"] == 1.0
                assert c["gen_ai.response.finish_reasons"] == ("stop",)
                assert c["gen_ai.usage.input_tokens"] > 0 and c["gen_ai.usage.output_tokens"] > 0
                assert c["gen_ai.usage.cache_read.input_tokens"] == 0 and c["server.address"] == "scripted"
                assert (
                    c["gen_ai.conversation.id"] == traj.session_id and c["openinference.span.kind"] == "LLM"
                )
                assert step["start"] <= call["start"] <= call["end"] <= step["end"]
            elif a["fsm.source"] == "PROCESSING_TOOLS":
                (tool,) = kids
                t = tool["attrs"]
                assert tool["name"] == "execute_tool calculator"
                assert t["gen_ai.operation.name"] == "execute_tool" and t["gen_ai.tool.name"] == "calculator"
                assert t["gen_ai.tool.type"] == "function" and t["openinference.span.kind"] == "TOOL"
                assert t["gen_ai.tool.description"] == "Evaluate an arithmetic expression."
                if _row_of(traj.session_id) == 1:  # "1 / 0": the calculator raised
                    assert tool["status"] == 2 and t["error.type"] == "exception"  # ERROR
                    assert "division by zero" in tool["status_message"]
                else:
                    assert tool["status"] == 0 and "error.type" not in t
            else:
                assert kids == []
        assert steps[-1]["attrs"]["fsm.termination_reason"] == "done"
        assert model_total == traj.response_mask.count(1)
        assert model_total + obs_total == len(traj.response_ids)
        # content is opt-in
        assert not any(
            k.startswith(("gen_ai.input", "gen_ai.output", "agentfsm.input_token"))
            for s in spans
            for k in s["attrs"]
        )


async def test_embedded_model_spans_over_otlp(receiver, tokenizer, agent):
    """The embedded model (backends/hf.py) is named by its served name in span names and gen_ai.request.model
    (not after its folder), with no server.address (it runs in this process); with content capture, every model
    span carries its input and output decoded as GenAI messages (roles from the prompt and the trajectory's
    segments; the parts' texts join up to the decoded token ids); every span has its OpenInference kind."""
    import json

    from backends.hf import HFBackend
    from backends.hf_model import TINY_SERVED_NAME
    from backends.tiny import ASSET_DIR

    def text(messages: str) -> str:
        return "".join(part["content"] for m in json.loads(messages) for part in m["parts"])

    async with HFBackend(ASSET_DIR, device="cpu", torch_threads=1) as backend:
        assert backend.model_name == TINY_SERVED_NAME == "agentfsm-tiny-calculator"
        with Telemetry(otlp=receiver.url, capture_content=True) as tel:
            trajs = await fsm.Runner(agent, backend, tokenizer, tracer=tel).run(make_prompts(3))
            stats = tel.stats()
    assert (
        stats["exported"] == len(receiver.spans) == sum(map(expected_spans, trajs)) and stats["dropped"] == 0
    )
    kinds = {"invoke_agent": "AGENT", "text_completion": "LLM", "execute_tool": "TOOL"}
    roles_seen = set()
    for s in receiver.spans:
        a = s["attrs"]
        assert a["openinference.span.kind"] == kinds.get(s["name"].split(" ")[0], "CHAIN"), s["name"]
        if s["parent"] is None:
            assert (
                a["gen_ai.request.model"] == "agentfsm-tiny-calculator"
                and a["gen_ai.provider.name"] == "transformers"
            )
        if not s["name"].startswith("text_completion"):
            continue
        assert s["name"] == "text_completion agentfsm-tiny-calculator"
        assert a["gen_ai.request.model"] == "agentfsm-tiny-calculator" and "server.address" not in a
        ids_in, ids_out = list(a["agentfsm.input_token_ids"]), list(a["agentfsm.output_token_ids"])
        inputs, (output,) = json.loads(a["gen_ai.input.messages"]), json.loads(a["gen_ai.output.messages"])
        assert text(a["gen_ai.input.messages"]) == tokenizer.decode(ids_in, skip_special_tokens=False)
        assert [m["role"] for m in inputs[:2]] == ["system", "user"]  # the prompt, message by message
        assert "What is" in inputs[1]["parts"][0]["content"]
        roles_seen.update(m["role"] for m in inputs)
        assert (
            output["role"] == "assistant"
            and output["finish_reason"] == a["gen_ai.response.finish_reasons"][0]
        )
        assert output["parts"] == [
            {"type": "text", "content": tokenizer.decode(ids_out, skip_special_tokens=False)}
        ]
    assert roles_seen <= {"system", "user", "assistant", "tool"}


async def test_sglang_spans_use_the_served_model_name(tokenizer, agent):
    """An SGLang client learns the served model name from /model_info with its first call, after the first
    spans started: they are named when they end. Calls carry the server's address and port."""
    from backends.devserver import DevServer
    from backends.scripted import echo_backend

    async with DevServer(echo_backend(vocab=500)) as server:
        with Telemetry(otlp=False, memory=True) as tel:
            engine = fsm.RolloutEngine(agent, tokenizer, servers=[server.url], tracer=tel)
            await engine.arun(make_prompts(4))
            await engine.aclose()
            spans = tel.finished_spans()
    calls = [s for s in spans if s.attributes.get("gen_ai.operation.name") == "text_completion"]
    roots = [s for s in spans if s.parent is None]
    assert calls and len(roots) == 4
    assert {s.name for s in calls} == {"text_completion echo"}
    assert {s.attributes["gen_ai.request.model"] for s in calls + roots} == {"echo"}
    assert {(s.attributes["server.address"], s.attributes["server.port"]) for s in calls} == {
        ("127.0.0.1", server.port)
    }


async def test_failures_become_error_spans(tokenizer, agent):
    with Telemetry(otlp=False, memory=True) as tel:
        trajs = await fsm.Runner(
            agent, calculator_model(tokenizer, dead_rows={0}), tokenizer, tracer=tel
        ).run(make_prompts(2))
        spans = tel.finished_spans()
    dead, alive = trajs
    assert dead.failed and not alive.failed
    mine = [s for s in spans if s.context.trace_id == _root(spans, dead).context.trace_id]
    names = {s.name: s for s in mine}
    assert set(names) == {
        "invoke_agent calculator",
        "PENDING -> GENERATING",
        "GENERATING -> error",
        "text_completion scripted",
    }
    for name in ("GENERATING -> error", "text_completion scripted"):
        span = names[name]
        assert span.status.status_code is otel_trace.StatusCode.ERROR
        assert span.attributes["error.type"] == "BackendUnavailable"
        assert [e.name for e in span.events] == ["exception"]
    root = names["invoke_agent calculator"]
    assert root.status.status_code is otel_trace.StatusCode.ERROR
    assert root.attributes["error.type"] == "backend"
    assert root.attributes["fsm.termination_reason"] == dead.termination_reason


def _root(spans, traj):
    (root,) = [
        s for s in spans if s.parent is None and s.attributes["gen_ai.conversation.id"] == traj.session_id
    ]
    return root


async def test_spans_are_current_where_the_work_runs(tokenizer, agent):
    """Inside the backend, the current span is that trajectory's model call, child of its GENERATING span;
    trajectories interleave (latency) without seeing each other's spans; a span user code starts there
    (through the SDK tracer) nests under it and leaves through the same exporters."""
    tel = Telemetry(otlp=False, memory=True)
    seen: list[tuple[str, Any]] = []

    def on_call(session_id: str) -> None:
        seen.append((session_id, otel_trace.get_current_span()))
        with tel.tracer.start_as_current_span("user work"):
            pass

    backend = calculator_model(tokenizer, on_call=on_call, latency_s=0.005)
    with tel:
        trajs = await fsm.Runner(agent, backend, tokenizer, tracer=tel).run(make_prompts(4))
        spans = {s.context.span_id: s for s in tel.finished_spans()}
    roots = {t.session_id: _root(spans.values(), t) for t in trajs}
    assert len(seen) == 8
    for session_id, current in seen:
        ctx = current.get_span_context()
        span = spans[ctx.span_id]
        assert span.name == "text_completion scripted"
        assert ctx.trace_id == roots[session_id].context.trace_id
        assert spans[span.parent.span_id].attributes["fsm.source"] == "GENERATING"
    user = [s for s in spans.values() if s.name == "user work"]
    assert len(user) == 8 and all(spans[s.parent.span_id].name == "text_completion scripted" for s in user)
    assert otel_trace.get_current_span() is otel_trace.INVALID_SPAN  # nothing leaks out of the run


async def test_sampling_keeps_whole_trajectories(tokenizer, agent):
    rows = make_prompts(20)
    with Telemetry(otlp=False, memory=True, sample=0.4) as tel:
        trajs = await fsm.Runner(agent, calculator_model(tokenizer), tokenizer, tracer=tel).run(rows, n=2)
        spans = tel.finished_spans()
        stats = tel.stats()
    kept = [t for t in trajs if tel.keeps(t.session_id)]
    assert 4 <= len(kept) <= 28  # 40 trajectories at 0.4
    assert stats["trajectories"] == len(kept) and stats["trajectories_sampled_out"] == 40 - len(kept)
    traces = by_trace([{"trace_id": s.context.trace_id, "span": s} for s in spans])
    assert len(traces) == len(kept)
    conv = {}
    for items in traces.values():
        (root,) = [i["span"] for i in items if i["span"].parent is None]
        conv[root.attributes["gen_ai.conversation.id"]] = len(items)
    assert conv == {t.session_id: expected_spans(t) for t in kept}  # every kept trajectory is whole
    # deterministic by session id: another tracer with the same fraction keeps the same ones
    other = Telemetry(otlp=False, sample=0.4)
    assert [other.keeps(t.session_id) for t in trajs] == [tel.keeps(t.session_id) for t in trajs]
    other.close()
    with Telemetry(otlp=False, memory=True, sample=0.5, sample_groups=True) as groups:
        trajs = await fsm.Runner(agent, calculator_model(tokenizer), tokenizer, tracer=groups).run(rows, n=3)
        traced = {s.attributes["gen_ai.conversation.id"] for s in groups.finished_spans() if s.parent is None}
    by_uid = defaultdict(set)
    for t in trajs:
        by_uid[t.uid].add(t.session_id in traced)
    assert all(len(kept) == 1 for kept in by_uid.values())  # a group is traced whole or not at all
    assert {True, False} <= set().union(*by_uid.values())
    with Telemetry(otlp=False, memory=True, sample=0.0) as none:
        await fsm.Runner(agent, calculator_model(tokenizer), tokenizer, tracer=none).run(rows[:3])
        assert none.finished_spans() == () and none.stats()["trajectories_sampled_out"] == 3


async def test_dropped_spans_are_counted_never_silent(receiver, tokenizer, agent, monkeypatch, caplog):
    """A tiny queue behind a blocked collector: the spans evicted are counted, warned about, and are exactly
    the ones the receiver never got."""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "60")  # the held request must not time out
    receiver.gate.clear()
    rows = make_prompts(6)
    done = []

    def on_done(traj) -> None:  # all spans of a trajectory have ended when it is done
        done.append(traj)
        if len(done) == len(rows):
            receiver.gate.set()

    tel = Telemetry(otlp=receiver.url, max_queue_size=4, max_export_batch_size=2, schedule_delay_millis=5)
    with caplog.at_level(logging.WARNING, logger="agentfsm.telemetry"), tel:
        runner = fsm.Runner(agent, calculator_model(tokenizer, latency_s=0.01), tokenizer, tracer=tel)
        run = asyncio.create_task(runner.run(rows, on_done=on_done))
        await asyncio.to_thread(receiver.first_request.wait, 10)  # the exporter is now stuck on request 1
        trajs = await run
        stats = tel.stats()
    produced = sum(map(expected_spans, trajs))
    assert stats["ended"] == produced
    assert stats["dropped_queue_full"] > 0 and stats["export_failed"] == 0
    assert stats["dropped"] == produced - len(receiver.spans)
    assert stats["exported"] == len(receiver.spans)
    assert stats["by_exporter"]["otlp"]["dropped"] == stats["dropped"]
    assert any(
        "spans dropped" in r.getMessage() and "max_queue_size" in r.getMessage() for r in caplog.records
    )


async def test_capture_content_is_opt_in(tokenizer, agent):
    with Telemetry(otlp=False, memory=True, capture_content=True) as tel:
        (traj,) = await fsm.Runner(agent, calculator_model(tokenizer), tokenizer, tracer=tel).run(
            make_prompts(1)
        )
        spans = tel.finished_spans()
    root = _root(spans, traj)
    assert '"role": "user"' in root.attributes["gen_ai.input.messages"]
    assert "#### 3" in root.attributes["gen_ai.output.messages"]
    assert "calculator" in root.attributes["gen_ai.tool.definitions"]
    (tool,) = [s for s in spans if s.name == "execute_tool calculator"]
    assert tool.attributes["gen_ai.tool.call.arguments"] == '{"expression": "1 + 2"}'
    assert tool.attributes["gen_ai.tool.call.result"] == "3"
    calls = [s for s in spans if s.name.startswith("text_completion")]
    assert list(calls[0].attributes["agentfsm.input_token_ids"]) == traj.prompt_ids.tolist()
    assert "What is" in calls[0].attributes["gen_ai.input.messages"]  # decoded: see the embedded-model test
    assert "#### 3" in calls[-1].attributes["gen_ai.output.messages"]


async def test_tracing_off_calls_nothing(tokenizer, agent, monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("a tracer hook ran with tracing off")

    for name in ("trajectory", "model_call", "tool_call", "flush", "stats"):
        monkeypatch.setattr(Telemetry, name, boom)
    monkeypatch.setattr(tel_spans._Span, "__init__", boom)
    trajs = await fsm.Runner(agent, calculator_model(tokenizer), tokenizer).run(make_prompts(3))
    assert all(t.termination_reason == "done" and not t.failed for t in trajs)


async def test_telemetry_is_a_tracer(tokenizer, agent):
    """Telemetry and the spans its hooks return have every member of fsm/run/tracer.py's protocols, each taking
    the arguments the driver passes (positionally)."""
    import inspect

    from fsm.run.tracer import CallSpan, RootSpan, Tracer

    def check(obj: Any, protocol: type) -> None:
        members = {
            name: fn for name, fn in vars(protocol).items() if not name.startswith("_") and callable(fn)
        }
        assert members, protocol
        for name, fn in members.items():
            args = list(inspect.signature(fn).parameters)[1:]  # the driver's arguments, without self
            inspect.signature(getattr(obj, name)).bind(*args)  # TypeError when obj cannot take them

    with Telemetry(otlp=False, memory=True) as tel:
        tracer: Tracer = tel  # what a type checker verifies
        check(tracer, Tracer)
        returned: list[Any] = []  # the spans the hooks give the driver

        def keeping(hook: Any) -> Any:
            def kept(*args: Any) -> Any:
                returned.append(hook(*args))
                return returned[-1]

            return kept

        for name in ("trajectory", "model_call", "tool_call"):
            setattr(tel, name, keeping(getattr(tel, name)))
        trajs = await fsm.Runner(agent, calculator_model(tokenizer), tokenizer, tracer=tel).run(
            make_prompts(1)
        )
    assert trajs[0].termination_reason == "done"
    by_kind = {type(span).__name__: span for span in returned}
    assert set(by_kind) == {"_Root", "_ModelSpan", "_ToolSpan"}
    check(by_kind.pop("_Root"), RootSpan)
    for span in by_kind.values():
        check(span, CallSpan)


def test_from_env(monkeypatch):
    assert Telemetry.from_env() is None  # nothing configured: tracing off
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://127.0.0.1:9/custom/path")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "traceidratio")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "0.25")
    tel = Telemetry.from_env()
    assert tel.otlp_endpoint == "http://127.0.0.1:9/custom/path"  # verbatim
    assert tel.sampler.get_description() == "TraceIdRatioBased{0.25}"  # the SDK's sampler from the variables
    assert tel.resource.attributes["service.name"] == "agentfsm"
    tel.close()
    explicit = Telemetry(otlp="http://127.0.0.1:9", sample=1.0)  # --otlp wins over the environment
    assert explicit.otlp_endpoint == "http://127.0.0.1:9/v1/traces" and explicit.sampler.rate == 1.0
    explicit.close()
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert Telemetry.from_env(otlp="http://127.0.0.1:9") is None
    with pytest.raises(ValueError, match="fraction"):
        Telemetry(otlp=False, sample=1.5)


def test_gen_ai_names_match_semconv():
    """Our literals equal the (deprecated-marked) semconv constants where those exist."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from opentelemetry.semconv._incubating.attributes import gen_ai_attributes as G
    for name in dir(T):
        if name.startswith("GEN_AI_") and hasattr(G, name):
            assert getattr(T, name) == getattr(G, name), name
    from opentelemetry.semconv.attributes import error_attributes, server_attributes

    assert (T.ERROR_TYPE, T.SERVER_ADDRESS, T.SERVER_PORT) == (
        error_attributes.ERROR_TYPE,
        server_attributes.SERVER_ADDRESS,
        server_attributes.SERVER_PORT,
    )


def test_server_address_and_port():
    assert tel_shapes._server("http://10.0.0.7:30000") == ("10.0.0.7", 30000)  # server.address, server.port
    assert tel_shapes._server("https://gpu.example") == ("gpu.example", 443)
    assert tel_shapes._server("hf-local") == ("hf-local", None)


def test_bench_tracing_runs():
    from bench.tracing import _bench_table, bench_tracing

    runs = (("null", 1.0), ("otlp", 1.0), ("memory", 0.0))
    result = bench_tracing(20, repeats=1, runs=runs, show=False)  # the engine workload: 20 spans each
    null, otlp, none = result["on"]
    assert null["spans_per_traj"] == otlp["spans_per_traj"] == result["spans_per_traced_trajectory"] == 20
    assert none["spans_per_traj"] == 0 and all(r["dropped"] == 0 for r in result["on"])
    assert result["off"]["traj_per_cpu_s"] > 0 and otlp["traj_per_cpu_s"] > 0
    assert "overhead" in _bench_table(result)
    calc = bench_tracing(10, repeats=1, workload="calculator", runs=(("encode", 1.0),), show=False)
    assert calc["on"][0]["spans_per_traj"] == calc["spans_per_traced_trajectory"] == 8


# --- the hand-written OTLP encoding and exporter --------------------------------------------------------------


async def test_otlp_encoding_matches_the_sdk_encoder(tokenizer, agent):
    """Every kind of span we queue (transition tuples, model/tool calls, roots with outcome and a link to the
    caller's span, error spans with exception events, attributes set through the API, opt-in content, spans
    of `Telemetry.tracer`) encodes to the very bytes the SDK's encoder makes of the same spans."""
    tel = Telemetry(otlp=False, memory=True, capture_content=True)

    def on_call(session_id: str) -> None:
        current = otel_trace.get_current_span()
        current.set_attributes({"x.neg": -5, "x.float": 0.25, "x.bool": False, "x.list": ["a", "b"]})
        with tel.tracer.start_as_current_span("user work", attributes={"x.n": 2**40}):
            pass

    backend = calculator_model(tokenizer, fail_rows={1}, dead_rows={2}, on_call=on_call)
    with tel.tracer.start_as_current_span("training step"):  # roots link to it
        trajs = await fsm.Runner(agent, backend, tokenizer, tracer=tel).run(make_prompts(4), n=2)
    tel.flush()
    items = list(tel.memory._items)  # as queued: tuples, span objects, ReadableSpans
    assert {type(i).__name__ for i in items} >= {"tuple", "_ModelSpan", "_Span", "ReadableSpan"}
    ours = tel_export._Encoder(tel.resource, tel.scope).request(items)
    sdk = encode_spans([tel_spans._readable(i, tel.resource, tel.scope) for i in items])
    assert ExportTraceServiceRequest.FromString(ours) == sdk
    assert ours == sdk.SerializeToString()
    spans = tel.finished_spans()
    failed = sum(2 for t in trajs if t.failed)  # "GENERATING -> error" and the failed model call
    user = len(backend.requests)  # "user work", one per model call
    assert len(spans) == sum(map(expected_spans, trajs)) + failed + user + 1  # + the training step
    for span in spans:  # failed model calls carry what they were asked
        if span.name.startswith("text_completion") and span.status.status_code is otel_trace.StatusCode.ERROR:
            assert '"role": "user"' in span.attributes["gen_ai.input.messages"]
    links = [s.links for s in spans if s.name == "invoke_agent calculator"]
    step = next(s for s in spans if s.name == "training step")
    assert all(link.context.span_id == step.context.span_id for (link,) in links)
    tel.close()


def test_otlp_encoding_of_values():
    """Attribute values of every OTLP type, and the attributes a shape derives from one value (sampling
    parameters, a server URL), decode as the SDK's encoding of the same span does."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope

    shape = tel_shapes._Shape(
        "text_completion m",
        tel_shapes._CLIENT,
        {"gen_ai.request.model": "m", "x.pi": 3.5},
        tel_shapes._MODEL_SLOTS,
    )
    params = {"temperature": 1, "top_p": 0.9, "top_k": -1, "max_new_tokens": 300, "sampling_seed": 2**63 - 1}
    values = (
        "conv-ü",
        params,
        (1, 2, 3),
        "length",
        300,
        2**20,
        0,
        "https://10.0.0.7:30000",
        "sticky",
        "v3",
        None,
        (7, 8),
    )
    item = (shape.id, 2**128 - 1, 2**64 - 1, 1, 1_700_000_000_000_000_000, 1_700_000_000_000_000_001, *values)
    resource, scope = (
        Resource.create({"service.name": "t", "x.list": (1.5, -2.0)}),
        InstrumentationScope("agentfsm"),
    )
    readable = tel_spans._readable(item, resource, scope)
    assert (
        readable.attributes["gen_ai.request.temperature"] == 1 and readable.attributes["server.port"] == 30000
    )
    assert readable.attributes["gen_ai.response.finish_reasons"] == ("length",)
    ours = tel_export._Encoder(resource, scope).request([item, item])  # the second from the caches
    assert ours == encode_spans([readable, readable]).SerializeToString()


async def test_otlp_exporter_retries_as_the_sdk(receiver, tokenizer, agent, monkeypatch):
    """429/502/503/504 are retried (Retry-After honoured), other errors are not; failures are counted."""
    receiver.responses = [(503, {"Retry-After": "0"}), (429, {"Retry-After": "0"})]
    tel = Telemetry(otlp=receiver.url)
    with tel:
        (traj,) = await fsm.Runner(agent, calculator_model(tokenizer), tokenizer, tracer=tel).run(
            make_prompts(1)
        )
        stats = tel.stats()
    assert len(receiver.headers) == 3 and stats["exported"] == len(receiver.spans) == expected_spans(traj)
    assert receiver.headers[0]["Content-Encoding"] == "gzip"
    assert receiver.headers[0]["Content-Type"] == "application/x-protobuf"
    receiver.responses = [(400, {})]
    with Telemetry(otlp=receiver.url) as tel:
        await fsm.Runner(agent, calculator_model(tokenizer), tokenizer, tracer=tel).run(make_prompts(1))
        stats = tel.stats()
    assert len(receiver.headers) == 4 and stats["export_failed"] == stats["ended"] and stats["exported"] == 0
    # nobody listens: retried until the deadline
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "0.5")
    with Telemetry(otlp="http://127.0.0.1:9") as tel:
        await fsm.Runner(agent, calculator_model(tokenizer), tokenizer, tracer=tel).run(make_prompts(1))
        assert tel.stats()["export_failed"] == tel.stats()["ended"] > 0


async def test_sampled_out_trajectories_cost_no_spans(tokenizer, agent, monkeypatch):
    """A trajectory sampled out gets no root, and its model and tool calls no span objects, even under a span
    the caller has open."""

    def boom(*args, **kwargs):
        raise AssertionError("a span was made for a sampled-out trajectory")

    monkeypatch.setattr(tel_spans._Root, "__init__", boom)
    monkeypatch.setattr("fsm.telemetry.tracer._new", boom)  # call spans are made with it
    with Telemetry(otlp=False, memory=True, sample=0.0) as tel:
        with tel.tracer.start_as_current_span("caller"):
            trajs = await fsm.Runner(agent, calculator_model(tokenizer), tokenizer, tracer=tel).run(
                make_prompts(3)
            )
        tel.flush()
        assert [s.name for s in tel.finished_spans()] == ["caller"]
    assert all(t.termination_reason == "done" for t in trajs)


async def test_spans_a_user_action_starts_are_children_of_its_state(tokenizer, monkeypatch):
    """A state whose action is user code (here the interaction) has its span current while it runs."""
    from specs.interactions import GuessNumber

    agent = fsm.compile_spec(REPO / "specs/interaction_agent.yaml")
    tel = Telemetry(otlp=False, memory=True)
    reply = GuessNumber.generate_response

    async def generate_response(self, instance_id, messages, **kwargs):
        with tel.tracer.start_as_current_span("simulator"):
            return await reply(self, instance_id, messages, **kwargs)

    monkeypatch.setattr(GuessNumber, "generate_response", generate_response)
    turns = [tokenizer.encode(t, add_special_tokens=False) + [tokenizer.eos_token_id] for t in ("3", "5")]
    backend = ScriptedBackend(lambda session, k, prompt: turns[k])
    row = {
        "raw_prompt": [{"role": "user", "content": "Guess my number."}],
        "interaction_kwargs": {"secret": 5},
    }
    with tel:
        (traj,) = await fsm.Runner(agent, backend, tokenizer, tracer=tel).run([row])
        spans = {s.context.span_id: s for s in tel.finished_spans()}
    assert traj.termination_reason == "interaction_done"
    user = [s for s in spans.values() if s.name == "simulator"]
    assert [spans[s.parent.span_id].name for s in user] == [
        "INTERACTING -> GENERATING",
        "INTERACTING -> TERMINATED",
    ]
    assert len(spans) == expected_spans(traj) + 2


async def test_the_exit_line_says_why_spans_were_not_exported(tokenizer, agent, caplog):
    """A collector that fails while the tracer closes: the exit warning says, per exporter, that the export
    failed and where it was going (it once read '24 of 64 spans were not exported before exit ()')."""
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

    release = threading.Event()

    class Down(SpanExporter):  # as an OTLP exporter whose collector is down: waits, then fails
        def export(self, spans):
            release.wait(30)
            return SpanExportResult.FAILURE

        def shutdown(self):
            release.set()

    # the run's own flush gives up at once, so the export is still hung when the tracer closes (with the 30 s
    # default the run's flush could outwait the export's failure, leaving nothing to lose at exit)
    tel = Telemetry(otlp=False, exporters=[Down()], schedule_delay_millis=5, flush_timeout_s=0.2)
    runner = fsm.Runner(agent, calculator_model(tokenizer), tokenizer, tracer=tel)
    await runner.run([{"raw_prompt": [{"role": "user", "content": "What is 2 + 3?"}]}])
    with caplog.at_level(logging.WARNING, logger="agentfsm.telemetry"):
        stats = tel.close(timeout_s=0.2)
    lines = [r.getMessage() for r in caplog.records if "not exported before exit" in r.getMessage()]
    assert stats["export_failed"] > 0 and len(lines) == 1, (stats, lines)
    assert "failed to export (is the collector up?)" in lines[0] and "()" not in lines[0], lines[0]


# --- the SDK's public API only; the SDK's own export path for its exporters; one line for a dead collector ------


def test_only_the_public_opentelemetry_api():
    """fsm/telemetry reaches no private name of the OpenTelemetry API or SDK (`_RUNTIME_CONTEXT`, the
    suppression key...): an SDK release may change those at any time."""
    import re

    private = re.compile(
        r"\botel_\w+\._\w|\bopentelemetry(\.\w+)*\._\w|from opentelemetry[\w.]* import [^\n]*\b_\w"
        r"|getattr\(otel_\w+,\s*['\"]_"
    )
    for path in sorted((REPO / "fsm/telemetry").glob("*.py")):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            assert not private.search(line), f"{path.name}:{n}: {line.strip()}"


async def test_sdk_exporters_see_the_same_spans(tokenizer, agent):
    """An SDK exporter (here its InMemorySpanExporter) runs behind the SDK's BatchSpanProcessor and gets the
    very spans the native path carries, counted the same way."""
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    sdk = InMemorySpanExporter()
    with Telemetry(otlp=False, memory=True, exporters=[sdk]) as tel:
        await fsm.Runner(agent, calculator_model(tokenizer, fail_rows={1}), tokenizer, tracer=tel).run(
            make_prompts(3)
        )
        stats = tel.stats()
        native = tel.finished_spans()
    assert isinstance(tel.processors[-1], T.SdkPipeline)

    def seen(spans: Any) -> list[tuple]:
        return sorted(
            (
                s.name,
                s.context.span_id,
                s.parent.span_id if s.parent else 0,
                s.start_time,
                s.end_time,
                s.status.status_code.value,
                tuple(sorted(s.attributes.items())),
            )
            for s in spans
        )

    assert seen(sdk.get_finished_spans()) == seen(native) and len(native) > 0
    by = stats["by_exporter"]
    assert by["memory"]["exported"] == by["InMemorySpanExporter0"]["exported"] == len(native)
    assert by["InMemorySpanExporter0"]["dropped"] == 0 and by["InMemorySpanExporter0"]["queued"] == 0


async def test_an_unreachable_collector_is_one_line(tokenizer, agent, monkeypatch, caplog):
    """Nobody listens at the endpoint: one error line says where and why; no retry chatter, no advice about
    the queue (nothing was queue-full), no second summary at exit; every span counted as failed."""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "1")
    with caplog.at_level(logging.DEBUG, logger="agentfsm.telemetry"):
        tel = Telemetry(otlp="http://127.0.0.1:9", max_export_batch_size=4, schedule_delay_millis=5)
        with tel:  # small batches: several exports fail, one line says so
            await fsm.Runner(agent, calculator_model(tokenizer, latency_s=0.01), tokenizer, tracer=tel).run(
                make_prompts(4)
            )
        stats = tel.stats()
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(lines) == 1, lines
    assert "http://127.0.0.1:9/v1/traces" in lines[0] and "refused" in lines[0].lower(), lines[0]
    assert "queue" not in lines[0]
    assert stats["ended"] > 4 and stats["export_failed"] == stats["dropped"] == stats["ended"]


def test_sampler_variables(monkeypatch, caplog):
    """OTEL_TRACES_SAMPLER as the SDK reads it (its own sampler decides): a trajectory's root has no parent, so
    parentbased_* decide as their root sampler; an unreadable or out-of-range ratio traces everything, with the
    SDK's line saying so."""
    keys = [f"session-{i}" for i in range(2000)]
    for sampler, arg, want in (
        ("parentbased_always_off", None, 0.0),
        ("parentbased_traceidratio", "0.3", 0.3),
        ("always_on", None, 1.0),
        ("traceidratio", "2", 1.0),
        ("traceidratio", "x", 1.0),
    ):
        monkeypatch.setenv("OTEL_TRACES_SAMPLER", sampler)
        if arg is not None:
            monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", arg)
        with caplog.at_level(logging.WARNING):
            tel = Telemetry(otlp=False)
        kept = sum(map(tel.keeps, keys)) / len(keys)
        assert abs(kept - want) < 0.04, (sampler, arg, kept)
        tel.close()
    assert [r.getMessage() for r in caplog.records] == 2 * [
        "Could not convert TRACES_SAMPLER_ARG to float. Using default rate 1.0."
    ]


@pytest.mark.parametrize(
    "env",
    [
        {
            "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318/base/",
            "OTEL_EXPORTER_OTLP_HEADERS": "X-Team=rl,token=a%20b",
            "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT": "7",
            "OTEL_EXPORTER_OTLP_TIMEOUT": "3",
            "OTEL_EXPORTER_OTLP_COMPRESSION": "GZIP",
            "OTEL_EXPORTER_OTLP_CERTIFICATE": "/ca.pem",
            "OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE": "/client.pem",
            "OTEL_EXPORTER_OTLP_TRACES_CLIENT_KEY": "/client.key",
        },
        {
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4318/custom",
            "OTEL_EXPORTER_OTLP_ENDPOINT": "http://other:4318",
            "OTEL_EXPORTER_OTLP_TRACES_HEADERS": "a=1",
            "OTEL_EXPORTER_OTLP_HEADERS": "b=2",
            "OTEL_EXPORTER_OTLP_TIMEOUT": "2.5",
            "OTEL_EXPORTER_OTLP_TRACES_COMPRESSION": "deflate",
            "OTEL_EXPORTER_OTLP_COMPRESSION": "gzip",
            "OTEL_EXPORTER_OTLP_TRACES_CLIENT_CERTIFICATE": "/client.pem",
        },
        {"OTEL_EXPORTER_OTLP_TIMEOUT": "soon", "OTEL_EXPORTER_OTLP_COMPRESSION": "zstd"},
    ],
)
def test_otlp_variables_are_read_as_the_sdk_exporter_reads_them(monkeypatch, env):
    """Our OTLP exporter, configured by the OTEL_EXPORTER_OTLP_* variables alone, sends where the SDK's own
    exporter sends, with its headers, timeout, compression and TLS files (the SDK's seen through its public
    `session=`: one empty export to a session that records the request)."""
    import os

    import requests
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope

    class Recording(requests.Session):
        def request(self, method, url, **kw):
            self.seen = {"url": url, "headers": {**self.headers, **(kw.get("headers") or {})}, **kw}
            answer = requests.Response()
            answer.status_code = 200
            return answer

    for name in [k for k in os.environ if k.startswith("OTEL_EXPORTER_OTLP_")]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    session = Recording()
    assert OTLPSpanExporter(session=session).export([]).name == "SUCCESS"
    sdk = session.seen
    sent = {
        k.lower(): v for k, v in sdk["headers"].items() if k.lower() not in ("user-agent", "content-length")
    }
    ours = tel_export.OtlpHttpExporter(Resource.create({}), InstrumentationScope("t"))
    assert ours.endpoint == sdk["url"]
    assert {k: v for k, v in ours.headers.items() if k != "user-agent"} == sent
    assert ours.compression == sent.get("content-encoding", "none")
    assert ours.timeout_s == pytest.approx(sdk["timeout"], abs=0.5)  # the SDK's: what is left of it
    settings = tel_export.OtlpSettings.from_env()
    verify, cert = sdk.get("verify", session.verify), sdk.get("cert", session.cert)
    assert settings.certificate == (None if verify is True else verify)
    assert (settings.client_certificate, settings.client_key) == (
        cert if isinstance(cert, tuple) else (cert, None)
    )


def test_boolean_variables_are_true_only_when_they_say_true(monkeypatch):
    """OTEL_SDK_DISABLED as the SDK reads it: "true" (any case) disables, "1" or "yes" do not."""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")
    for value, disabled in (("TRUE", True), ("1", False), ("yes", False)):
        monkeypatch.setenv("OTEL_SDK_DISABLED", value)
        tel = Telemetry.from_env()
        assert (tel is None) == disabled, value
        if tel is not None:
            tel.close()


def test_bench_tracing_sdk_runs():
    """bench/tracing_sdk.py's paths each deliver every span of every trajectory to its collector."""
    from bench.tracing_sdk import PATHS, bench

    result = bench("calculator", n=20, rounds=1)
    assert set(result["cpu"]) == set(PATHS) and all(v["median"] > 0 for v in result["cpu"].values())
    assert result["spans_per_run"] == {"ours": 160, "sdk-exporter": 160, "sdk-bsp": 160}
    assert result["spans_dropped"] == {"ours": [0], "sdk-exporter": [0], "sdk-bsp": [0]}
