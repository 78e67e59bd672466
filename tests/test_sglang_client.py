"""SGLangBackend against literal SGLang 0.5.23 response bodies (reference/sglang-http.md), served on loopback."""

from __future__ import annotations

import asyncio
import json
import socket
from collections import defaultdict, deque
from typing import Any

import pytest
from aiohttp import web

from backends.base import (
    BackendError,
    BackendRequestError,
    BackendTimeout,
    BackendUnavailable,
    GenerateRequest,
)
from backends.launcher import LaunchError, SGLangLauncher
from backends.sglang import SGLangBackend

PROMPT = [151644, 872, 198, 9707, 151645, 198, 151644, 77091, 198]

MODEL_INFO = {
    "model_path": "Qwen/Qwen2.5-0.5B-Instruct",
    "served_model_name": "Qwen/Qwen2.5-0.5B-Instruct",
    "tokenizer_path": "Qwen/Qwen2.5-0.5B-Instruct",
    "is_generation": True,
    "preferred_sampling_params": None,
    "weight_version": "default",
    "load_format": "auto",
    "reasoning_parser": None,
    "tool_call_parser": None,
    "disaggregation_mode": "null",
    "has_image_understanding": False,
    "has_audio_understanding": False,
    "model_type": "qwen2",
    "architectures": ["Qwen2ForCausalLM"],
}
SERVER_INFO = {
    "model_path": "Qwen/Qwen2.5-0.5B-Instruct",
    "context_length": None,
    "max_total_num_tokens": 500000,
    "max_req_input_len": 32762,
    "internal_states": [{}],
    "version": "0.5.23",
}

# The reference's example, byte for byte.
OK_STOP = json.loads("""
{"text":"Hello! How can I help?",
 "output_ids":[9707,0,2585,646,358,1492,30,151645],
 "meta_info":{"id":"traj42_t03","finish_reason":{"type":"stop","matched":151645},
  "prompt_tokens":9,"weight_version":"default","num_retractions":0,
  "input_token_logprobs":[],
  "output_token_logprobs":[[-0.0213,9707,null],[-0.4471,0,null],[-0.1032,2585,null],[-0.0087,646,null],
                           [-0.0011,358,null],[-0.0159,1492,null],[-0.0402,30,null],[-0.0005,151645,null]],
  "output_token_logprobs_length":8,"reasoning_tokens":0,"completion_tokens":8,
  "cached_tokens":0,"cached_tokens_details":null,"dp_rank":0,
  "e2e_latency":0.0843,"response_sent_to_client_ts":1793000000.123}}
""")
OK_LENGTH = json.loads("""
{"text":"Hello! How","output_ids":[9707,0,2585],
 "meta_info":{"id":"traj42_t04","finish_reason":{"type":"length","length":3},
  "prompt_tokens":9,"weight_version":"step-7","num_retractions":0,"input_token_logprobs":[],
  "output_token_logprobs":[[-0.0213,9707,null],[-0.4471,0,null],[-0.1032,2585,null]],
  "output_token_logprobs_length":3,"reasoning_tokens":0,"completion_tokens":3,
  "cached_tokens":8,"cached_tokens_details":{"device":8,"host":0},"dp_rank":0,
  "e2e_latency":0.031,"response_sent_to_client_ts":1793000001.5}}
""")
ABORT_RUNNING = json.loads("""
{"text":"Hello!","output_ids":[9707,0],
 "meta_info":{"id":"traj42_t05","finish_reason":{"type":"abort","message":"Aborted","status_code":null,"err_type":null},
  "prompt_tokens":9,"weight_version":"default","num_retractions":0,"input_token_logprobs":[],
  "output_token_logprobs":[[-0.0213,9707,null],[-0.4471,0,null]],"output_token_logprobs_length":2,
  "reasoning_tokens":0,"completion_tokens":2,"cached_tokens":0,"cached_tokens_details":null,"dp_rank":0,
  "e2e_latency":0.2,"response_sent_to_client_ts":1793000002.0}}
""")
ABORT_WAITING = json.loads("""
{"text":"","output_ids":[],
 "meta_info":{"id":"traj7_t01","finish_reason":{"type":"abort","message":"Abort in waiting queue"},
  "weight_version":"default","e2e_latency":0.0012,"input_token_logprobs":[],"output_token_logprobs":[],
  "output_token_logprobs_length":0,"completion_tokens":0}}
""")
PHANTOM = json.loads("""
{"text":"","output_ids":[],
 "meta_info":{"id":"traj9_t00","finish_reason":{"type":"length","length":0},"prompt_tokens":9,
  "weight_version":"default","num_retractions":0,"input_token_logprobs":[],
  "output_token_logprobs":[[-1.25,9707,null]],"output_token_logprobs_length":1,"reasoning_tokens":0,
  "completion_tokens":0,"cached_tokens":0,"cached_tokens_details":null,"dp_rank":0,"e2e_latency":0.01,
  "response_sent_to_client_ts":1793000003.0}}
""")
ERR_CONTRACT = {
    "error": "unknown field `seed`, expected one of `max_new_tokens`, `min_new_tokens`, `temperature`"
}
ERR_VALUE = {
    "error": {"message": "The input (40000 tokens) is longer than the model's context length (32768 tokens)."}
}
ERR_PARSE = {
    "object": "error",
    "message": "1 validation error for GenerateReqInput",
    "type": "Bad Request",
    "param": None,
    "code": 400,
}
ERR_503 = {
    "object": "error",
    "message": "Request timed out in the waiting queue",
    "type": "503",
    "param": None,
    "code": 503,
}

Reply = tuple[int, Any]  # (status, JSON body), or (status, "disconnect" | ("sleep", seconds, reply))


class FakeSGLang:
    """A loopback app answering each path from a queue of canned replies (the last one repeats)."""

    def __init__(self) -> None:
        self.replies: dict[str, deque[Any]] = defaultdict(deque)
        self.replies["/model_info"].append((200, MODEL_INFO))
        self.replies["/server_info"].append((200, SERVER_INFO))
        self.seen: list[tuple[str, Any]] = []
        self.url = ""

    def on(self, path: str, *replies: Any) -> None:
        self.replies[path] = deque(replies)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json() if request.can_read_body else None
        self.seen.append((request.path, body))
        queue = self.replies.get(request.path)
        if not queue:
            return web.json_response({"detail": "Not Found"}, status=404)
        reply = queue.popleft() if len(queue) > 1 else queue[0]
        if reply == "disconnect":
            assert request.transport is not None
            request.transport.abort()
            await asyncio.sleep(0.05)
            return web.Response()
        if isinstance(reply, tuple) and reply[0] == "sleep":
            await asyncio.sleep(reply[1])
            reply = reply[2]
        status, payload = reply
        return web.json_response(payload, status=status)

    def paths(self, path: str) -> list[Any]:
        return [body for p, body in self.seen if p == path]


@pytest.fixture
async def fake():
    srv = FakeSGLang()
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", srv.handle)
    runner = web.AppRunner(
        app, access_log=None, handler_cancellation=True
    )  # a client that leaves ends its handler
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    srv.url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    yield srv
    await runner.cleanup()


def client(url: str, **kw: Any) -> SGLangBackend:
    return SGLangBackend(url, backoff_s=0.01, **kw)


def req(rid: str = "traj42_t03", **params: Any) -> GenerateRequest:
    return GenerateRequest(
        "traj42", list(PROMPT), params or {"max_new_tokens": 64, "stop_token_ids": [151645]}, rid=rid
    )


async def test_success_with_logprobs_and_exact_payload(fake):
    fake.on("/generate", (200, OK_STOP))
    async with client(fake.url) as b:
        res = await b.generate(req())
        assert b.model_name == "Qwen/Qwen2.5-0.5B-Instruct"
        assert b.context_length == 32768  # max_req_input_len + 6 when context_length is null (as 0.5.23)
    assert res.token_ids == [9707, 0, 2585, 646, 358, 1492, 30, 151645]  # the stop id included
    assert res.logprobs == [-0.0213, -0.4471, -0.1032, -0.0087, -0.0011, -0.0159, -0.0402, -0.0005]
    assert (res.finish_reason, res.prompt_tokens, res.cached_tokens) == ("stop", 9, 0)
    assert res.weight_version == "default" and res.server == fake.url and res.extra["id"] == "traj42_t03"
    [sent] = fake.paths("/generate")
    assert sent == {
        "input_ids": PROMPT,
        "rid": "traj42_t03",
        "return_logprob": True,
        "sampling_params": {"max_new_tokens": 64, "stop_token_ids": [151645]},
    }


async def test_length_stop(fake):
    fake.on("/generate", (200, OK_LENGTH))
    async with client(fake.url) as b:
        res = await b.generate(req("traj42_t04", max_new_tokens=3))
    assert (res.finish_reason, res.token_ids, res.cached_tokens, res.weight_version) == (
        "length",
        [9707, 0, 2585],
        8,
        "step-7",
    )
    assert len(res.logprobs) == 3


async def test_abort_mid_run_keeps_partial_output(fake):
    fake.on("/generate", (200, ABORT_RUNNING))
    async with client(fake.url) as b:
        res = await b.generate(req("traj42_t05"))
    assert (res.finish_reason, res.abort_message, res.token_ids, res.logprobs) == (
        "abort",
        "Aborted",
        [9707, 0],
        [-0.0213, -0.4471],
    )


async def test_abort_in_waiting_queue_lacks_prompt_and_cached_tokens(fake):
    fake.on("/generate", (200, ABORT_WAITING))
    async with client(fake.url) as b:
        res = await b.generate(req("traj7_t01"))
    assert (res.finish_reason, res.abort_message) == ("abort", "Abort in waiting queue")
    assert res.prompt_tokens is None and res.cached_tokens is None
    assert res.token_ids == [] and res.logprobs == []


async def test_phantom_logprob_entry_with_zero_new_tokens(fake):
    fake.on("/generate", (200, PHANTOM))
    async with client(fake.url) as b:
        res = await b.generate(req("traj9_t00", max_new_tokens=0))
    assert res.token_ids == [] and res.logprobs == [] and res.finish_reason == "length"


async def test_logprob_count_mismatch_is_an_error(fake):
    broken = json.loads(json.dumps(OK_STOP))
    broken["meta_info"]["output_token_logprobs"] = broken["meta_info"]["output_token_logprobs"][:5]
    fake.on("/generate", (200, broken))
    async with client(fake.url) as b:
        with pytest.raises(BackendError, match="5 output logprobs for 8 output ids"):
            await b.generate(req())


@pytest.mark.parametrize(
    "body, message",
    [
        (ERR_CONTRACT, "unknown field `seed`"),
        (ERR_VALUE, "The input (40000 tokens) is longer than the model's context length"),
        (ERR_PARSE, "1 validation error for GenerateReqInput"),
    ],
)
async def test_400_bodies_carry_the_server_message(fake, body, message):
    fake.on("/generate", (400, body))
    async with client(fake.url) as b:
        with pytest.raises(BackendRequestError) as ei:
            await b.generate(req())
    assert message in str(ei.value) and ei.value.status == 400 and not ei.value.retryable
    assert len(fake.paths("/generate")) == 1  # never retried


async def test_503_then_success_is_retried(fake):
    fake.on("/generate", (503, ERR_503), (503, ERR_503), (200, OK_STOP))
    async with client(fake.url) as b:
        res = await b.generate(req())
    assert res.finish_reason == "stop" and len(fake.paths("/generate")) == 3


async def test_persistent_503_becomes_unavailable_naming_the_url(fake):
    fake.on("/generate", (503, ERR_503))
    async with client(fake.url, max_retries=2) as b:
        with pytest.raises(BackendUnavailable) as ei:
            await b.generate(req())
    assert fake.url in str(ei.value) and "Request timed out in the waiting queue" in str(ei.value)
    assert ei.value.retryable and ei.value.server == fake.url and len(fake.paths("/generate")) == 3


async def test_server_disconnect_is_retried(fake):
    fake.on("/generate", "disconnect", (200, OK_STOP))
    async with client(fake.url) as b:
        res = await b.generate(req())
    assert res.finish_reason == "stop" and len(fake.paths("/generate")) == 2


async def test_deadline_aborts_the_rid_and_takes_the_late_partial_answer(fake):
    # A live server answers an aborted request itself, with what it generated so far: that answer is kept.
    fake.on("/generate", ("sleep", 0.4, (200, ABORT_RUNNING)), (200, OK_STOP))
    fake.on("/abort_request", (200, None))
    async with client(fake.url, request_timeout_s=0.2, abort_grace_s=2) as b:
        res = await b.generate(req("traj42_t05"))
        stats = b.stats()
    assert (res.finish_reason, res.token_ids) == ("abort", [9707, 0])
    assert fake.paths("/abort_request") == [{"rid": "traj42_t05"}] and len(fake.paths("/generate")) == 1
    assert (stats["aborts_sent"], stats["faults"]["aborts_running"], stats["faults"]["timeouts"]) == (1, 1, 0)


@pytest.mark.slow
async def test_the_partial_answer_is_awaited_as_long_as_a_loaded_server_takes(fake):
    """Issue 26 item 7: SGLang answers an aborted request 0.7-1.4 s after /abort_request under load. With a 1 s
    deadline the client waited deadline/10 (0.1 s) and lost the partial answer; the default now waits for it."""
    fake.on("/generate", ("sleep", 2.4, (200, ABORT_RUNNING)))  # answered 1.4 s after the 1 s deadline
    fake.on("/abort_request", (200, None))
    async with client(fake.url, request_timeout_s=1.0) as b:
        res = await b.generate(req("traj42_t05"))
    assert (res.finish_reason, res.token_ids) == ("abort", [9707, 0])


async def test_a_rid_the_server_may_still_hold_is_never_sent_again(fake):
    """After a deadline without an answer (the abort lost) or a 400 "Duplicate request ID", the server may hold
    the rid: the next attempt, here the router's re-route to the only server, goes out under a fresh rid."""
    fake.on("/generate", ("sleep", 30, (200, OK_STOP)), (200, OK_STOP))
    fake.on("/abort_request", (200, None))
    async with client(fake.url, abort_grace_s=0.05) as b:
        with pytest.raises(BackendTimeout):
            await b.generate(GenerateRequest("traj42", list(PROMPT), {}, rid="traj42_t03", timeout_s=0.2))
        res = await b.generate(GenerateRequest("traj42", list(PROMPT), {}, rid="traj42_t03", timeout_s=5))
        resumed = await b.generate(
            GenerateRequest("traj42", list(PROMPT), {}, rid="traj42_t03_r1", timeout_s=5)
        )
    assert res.finish_reason == "stop" and resumed.finish_reason == "stop"
    first, second, third = (body["rid"] for body in fake.paths("/generate"))
    assert first == "traj42_t03" and second.startswith("traj42_x") and third.startswith("traj42_x")
    fake.on(
        "/generate", (400, {"error": {"message": "Duplicate request ID detected: traj7_t00"}}), (200, OK_STOP)
    )
    async with client(fake.url, max_retries=1) as b:
        res = await b.generate(GenerateRequest("traj7", list(PROMPT), {}, rid="traj7_t00", timeout_s=5))
    rids = [body["rid"] for body in fake.paths("/generate")][3:]
    assert res.finish_reason == "stop" and rids[0] == "traj7_t00" and rids[1].startswith("traj7_x"), rids


async def test_a_hung_generate_is_aborted_and_not_retried_on_the_same_server(fake):
    fake.on("/generate", ("sleep", 30, (200, OK_STOP)))
    fake.on("/abort_request", (200, None))
    async with client(fake.url, abort_grace_s=0.05) as b:
        with pytest.raises(BackendTimeout, match="no answer within 0.2 s") as ei:
            await b.generate(GenerateRequest("traj42", list(PROMPT), {}, rid="traj42_t03", timeout_s=0.2))
        stats = b.stats()
    assert ei.value.retryable and ei.value.server == fake.url  # the router fails over on it
    assert fake.paths("/abort_request") == [{"rid": "traj42_t03"}] and len(fake.paths("/generate")) == 1
    assert (stats["faults"]["timeouts"], stats["aborts_sent"], stats["retries"]) == (1, 1, 0)


async def test_connection_refused():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    async with client(url, max_retries=1) as b:
        with pytest.raises(BackendUnavailable, match=f"{url} unavailable after 2 attempt"):
            await b.generate(req())


async def test_max_new_tokens_clamped_to_the_room_left(fake):
    fake.on("/server_info", (200, {**SERVER_INFO, "context_length": 16, "max_req_input_len": 10}))
    fake.on("/generate", (200, OK_LENGTH))
    async with client(fake.url) as b:
        await b.generate(req(max_new_tokens=100))  # 9 prompt tokens: room is 16 - 1 - 9 = 6
        await b.generate(req(temperature=0.5))  # absent means SGLang's default 128: clamped too
        await b.generate(req(max_new_tokens=3))  # fits: sent unchanged (the fake's answer has 3 ids)
        with pytest.raises(BackendRequestError, match="reaches the server's max input length 10"):
            await b.generate(GenerateRequest("t", list(range(10)), {"max_new_tokens": 4}))
    sent = [body["sampling_params"] for body in fake.paths("/generate")]
    assert sent == [{"max_new_tokens": 6}, {"temperature": 0.5, "max_new_tokens": 6}, {"max_new_tokens": 3}]


async def test_model_info_falls_back_to_deprecated_routes(fake):
    fake.on("/model_info")  # 404, as on older servers
    fake.on("/server_info")
    fake.on(
        "/get_model_info",
        (
            200,
            {
                "model_path": "/models/old",
                "tokenizer_path": "/models/old",
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": "default",
            },
        ),
    )
    fake.on("/get_server_info", (200, {**SERVER_INFO, "context_length": 2048}))
    fake.on("/generate", (200, OK_STOP))
    async with client(fake.url) as b:
        await b.generate(req())
        assert (await b.model_info())["model_path"] == "/models/old"
        assert b.model_name == "/models/old" and b.context_length == 2048
    paths = [p for p, _ in fake.seen]
    assert paths.index("/model_info") < paths.index("/get_model_info") < paths.index("/generate")


async def test_generated_rid_is_not_a_prefix_of_turn_rids(fake):
    fake.on("/generate", (200, OK_STOP))
    async with client(fake.url) as b:
        await b.generate(GenerateRequest("traj42", list(PROMPT), {}))
        await b.generate(GenerateRequest("traj42", list(PROMPT), {}))
    a, c = (body["rid"] for body in fake.paths("/generate"))
    assert a != c and a.startswith("traj42_g") and not c.startswith(a) and not "traj42_t01".startswith(a)


def test_the_rid_index_answers_prefix_relations_as_a_scan_of_every_rid_would():
    """_wire_rid asks whether a rid and a live or held one prefix one another once per attempt; the index
    answers it without a scan of every rid in flight (1,000 in flight: 1,000 comparisons a call)."""
    import random
    from collections import Counter

    from backends.sglang import _Rids

    rng = random.Random(7)
    index, plain = _Rids(), {}
    words = ["s1", "s1-1", "s1-10", "s2", "s12", "s1-1_t0", "s1-1_t01", "s1-10_t0_r1", "x"]
    for _ in range(3000):
        rid = rng.choice(words) + rng.choice(["", "_t0", "_t1", "_t0_r1", "0"])
        if rng.random() < 0.6:
            index[rid] = plain[rid] = rng.random()
        elif rid in plain and rng.random() < 0.3:
            del index[rid], plain[rid]
        else:
            assert index.pop(rid, None) == plain.pop(rid, None)
        probe = rng.choice(words) + rng.choice(["", "_t0", "_t0_r", "1"])
        scan = any(o.startswith(probe) or probe.startswith(o) for o in plain)
        assert index.prefix_related(probe) == scan, (probe, sorted(plain))
        assert index._sorted == sorted(plain) and dict(index) == plain
        assert index._lengths == Counter(map(len, plain))  # a lookup per length in use, none left behind


async def test_launcher_surfaces_a_crash_with_the_log_tail(tmp_path):
    launcher = SGLangLauncher(
        "m", module="backends.no_such_server", log_dir=tmp_path, base_port=1, startup_timeout_s=30
    )
    with pytest.raises(LaunchError) as ei:
        async with launcher:
            pass
    assert "exited with code 1" in str(ei.value) and "No module named backends.no_such_server" in str(
        ei.value
    )
    assert all(p.poll() is not None for p in launcher.procs)


# -- what real SGLang does (tests/fixtures/sglang), over the dev server, which answers the same way --------


async def test_requests_held_by_a_pause_do_not_time_out_and_send_no_lost_abort():
    """SGLang holds a request that arrives while paused, and an abort of it is lost: while this client has
    the server paused its deadlines stand still."""
    from backends.devserver import DevServer
    from backends.scripted import echo_backend

    async with DevServer(echo_backend()) as dev, client(dev.url, request_timeout_s=0.2) as b:
        await b.pause_generation("abort")
        turn = asyncio.ensure_future(b.generate(GenerateRequest("h", [1, 2, 3], {}, rid="h_t00")))
        done, _ = await asyncio.wait({turn}, timeout=0.6)  # three deadlines' worth of waiting
        assert not done
        await b.continue_generation()
        res = await turn
    assert res.finish_reason == "stop" and b.counts["aborts_sent"] == 0 and b.faults["timeouts"] == 0


async def test_a_resume_sent_while_its_turn_lives_gets_a_rid_that_no_abort_of_the_turn_reaches():
    from backends.devserver import DevServer
    from backends.scripted import echo_backend

    async with DevServer(echo_backend(latency_s=0.5)) as dev, client(dev.url) as b:
        old = asyncio.ensure_future(b.generate(GenerateRequest("s", [1, 2, 3], {}, rid="s_t00")))
        while "s_t00" not in dev._live:
            await asyncio.sleep(0.005)
        new = asyncio.ensure_future(b.generate(GenerateRequest("s", [1, 2, 3], {}, rid="s_t00_r1")))
        while len(dev._live) < 2:
            await asyncio.sleep(0.005)
        live = list(dev._live)
        assert "s_t00_r1" not in live and not any(a != c and c.startswith(a) for a in live for c in live)
        await b.abort_request("s_t00")
        assert (await old).finish_reason == "abort" and (await new).finish_reason == "stop"


@pytest.mark.parametrize(
    "scenario, name, kind, n",
    [
        ("aborts", "aborted_running", "running", None),
        ("pauses", "aborted_waiting", "waiting", 0),
        ("pauses", "paused_abort", "running", None),
        ("generate", "zero_new", None, 0),
    ],
)
def test_real_sglang_bodies_parse(scenario, name, kind, n):
    """Real SGLang 0.5.23's recorded answers (tests/fixtures/sglang): a running abort's partial output with its
    logprobs, a waiting-queue abort (text "", an empty weight_versions span, no prompt/cached tokens), and
    max_new_tokens 0."""
    from backends.sglang import parse_generate
    from tests.conftest import REPO

    exchanges = json.loads((REPO / "tests" / "fixtures" / "sglang" / f"{scenario}.json").read_text())[
        "exchanges"
    ]
    body = next(e["body"] for e in exchanges if e["name"] == name)
    res = parse_generate(body, server="sglang", return_logprob=True, rid=name)
    assert res.token_ids == body["output_ids"] and (n is None or len(res.token_ids) == n)
    assert res.logprobs is not None and len(res.logprobs) == len(res.token_ids)
    assert res.extra["token_versions"] == [res.weight_version] * len(res.token_ids)
    assert res.extra.get("abort_kind") == kind
    if kind == "waiting":
        assert (
            res.prompt_tokens is None
            and res.cached_tokens is None
            and res.abort_message == "Abort in waiting queue"
        )


def test_a_launched_server_dies_with_the_process_that_launched_it(tmp_path):
    """kill -9 of the launching process (the OOM killer, a scheduler) leaves no orphaned server holding its
    port and memory: the kernel sends the server SIGTERM (PR_SET_PDEATHSIG)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from tests.conftest import REPO

    script = (
        "import asyncio, sys\n"
        "from backends.launcher import SGLangLauncher\n"
        "async def main():\n"
        f"    l = SGLangLauncher('unused', base_port={_free_port()}, log_dir=sys.argv[1], module='backends.devserver',\n"
        "                       extra_args=['--scripted'], startup_timeout_s=60)\n"
        "    async with l:\n"
        "        print(l.procs[0].pid, flush=True)\n"
        "        await asyncio.sleep(3600)\n"
        "asyncio.run(main())\n"
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", script, str(tmp_path)],
        stdout=subprocess.PIPE,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        text=True,
    )
    try:
        server = int(parent.stdout.readline())  # the server answered /health
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=30)
        deadline = time.monotonic() + 30
        while _alive(server):
            assert time.monotonic() < deadline, f"server {server} outlived its launcher by 30 s"
            time.sleep(0.05)
    finally:
        parent.kill()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _alive(pid: int) -> bool:
    """Whether pid is a process that has not exited (a zombie waiting for its reaper counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
