"""Safe and bounded: keys, isolation between sessions, size/message/turn limits, histories that differ, harnesses
that hang or spin, commands. Each case runs a real harness state over the gateway's real HTTP."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from fsm.api import RolloutEngine
from fsm.gateway import Gateway, GatewayLimits, HarnessCall, harness
from tests.conftest import extra
from tests.gateway.conftest import row, scripted

BASE = Path(__file__).resolve().parents[2] / "examples" / "gateway" / "base.yaml"
SHARED: dict[str, Any] = {}


def spec(tmp_path: Path, action: str, limits: str = "") -> Path:
    path = tmp_path / "spec.yaml"
    path.write_text(f"""name: hostile
extends: {BASE}
{limits}
states:
  HARNESS:
    action: {action}
    next:
      - {{to: GENERATING, when: harness_calling}}
      - {{to: TERMINATED, when: harness_failed, reason: harness_failed}}
      - {{to: TERMINATED, reason: done}}
""")
    return path


def run(
    path: Path,
    tokenizer: Any,
    rows: list[dict],
    gateway: Gateway | None = None,
    turns: list[str] | None = None,
):
    backend = scripted(tokenizer, turns)
    with RolloutEngine(str(path), tokenizer, backend=backend) as engine:
        if gateway is not None:
            _attach(gateway, engine)
        return engine._run_sync(engine.arun(rows)), backend


def _attach(gateway: Gateway, engine: Any) -> None:
    """`gateway` is `engine`'s: its harness states use it (started on the engine's loop at the first, closed with
    the engine), as fsm/gateway/serve.py `serve` attaches one."""
    gateway.attach(engine.owned)


async def post(
    call: HarnessCall,
    path: str,
    body: Any,
    *,
    key: str | None = None,
    raw: bytes | None = None,
    base: str | None = None,
) -> tuple[int, Any]:
    headers = {
        "Authorization": f"Bearer {call.api_key if key is None else key}",
        "Content-Type": "application/json",
    }
    async with aiohttp.ClientSession() as http:
        data = raw if raw is not None else json.dumps(body).encode()
        async with http.post(f"{base or call.base_url}/{path}", data=data, headers=headers) as r:
            text = await r.text()
            try:
                return r.status, json.loads(text)
            except ValueError:
                return r.status, text


def chat(*messages: dict, **more: Any) -> dict:
    return {"model": "m", "messages": list(messages), **more}


USER = {"role": "user", "content": "What is 1 + 2?"}


async def probe_auth(call: HarnessCall) -> dict:
    out = {}
    out["no_key"] = await post(call, "chat/completions", chat(USER), key="")
    out["wrong_key"] = await post(call, "chat/completions", chat(USER), key="x" * 32)
    out["anthropic_wrong_key"] = await post(
        call, "messages", {"model": "m", "max_tokens": 8, "messages": [USER]}, key="nope"
    )
    # the other row's session, with this row's key: refused; its own key works only there
    SHARED.setdefault("calls", []).append(call)
    while len(SHARED["calls"]) < 2:
        await asyncio.sleep(0.01)
    other = next(c for c in SHARED["calls"] if c is not call)
    out["other_session"] = await post(call, "chat/completions", chat(USER), base=other.base_url)
    out["bad_json"] = await post(call, "chat/completions", None, raw=b"{not json")
    out["deep_json"] = await post(call, "chat/completions", None, raw=b"[" * 100_000 + b"]" * 100_000)
    out["not_object"] = await post(call, "chat/completions", [1, 2])
    out["image"] = await post(
        call, "chat/completions", chat({"role": "user", "content": [{"type": "image_url"}]})
    )
    out["too_big"] = await post(call, "chat/completions", chat({"role": "user", "content": "x" * 300_000}))
    out["too_big_chunked"] = await _chunked(
        call, json.dumps(chat({"role": "user", "content": "x" * 300_000})).encode()
    )
    out["too_many"] = await post(call, "chat/completions", chat(*[USER] * 50))
    out["unknown_api"] = await post(call, "chat/nope", chat(USER))
    out["outside"] = await post(call, "../../other", chat(USER))
    async with (
        aiohttp.ClientSession() as http,
        http.get(
            f"{call.base_url}/chat/completions", headers={"Authorization": f"Bearer {call.api_key}"}
        ) as r,
    ):
        out["get"] = r.status, await r.json()
    out["n"] = await post(call, "chat/completions", chat(USER, n=2))
    out["ok"] = await post(call, "chat/completions", chat(USER))
    return out


async def _chunked(call: HarnessCall, data: bytes) -> tuple[int, Any]:
    """A body sent chunked (no Content-Length): the bound holds while it streams."""

    async def chunks():
        for k in range(0, len(data), 16_384):
            yield data[k : k + 16_384]

    async with (
        aiohttp.ClientSession() as http,
        http.post(
            f"{call.base_url}/chat/completions",
            data=chunks(),
            headers={"Authorization": f"Bearer {call.api_key}"},
        ) as r,
    ):
        return r.status, await r.json()


auth_harness = harness(probe_auth, timeout_s=60)


def test_keys_isolation_and_bounds(tmp_path, tokenizer):
    SHARED.clear()
    gateway = Gateway(limits=GatewayLimits(max_request_bytes=200_000, max_messages=20))
    trajs, backend = run(
        spec(tmp_path, "tests.gateway.test_hostile:auth_harness"), tokenizer, [row(), row()], gateway
    )
    for traj in trajs:
        out = traj.extra["harness"]["result"]
        for name in ("no_key", "wrong_key", "other_session"):
            status, body = out[name]
            assert status == 401 and body["error"]["code"] == "invalid_api_key", (name, out[name])
        assert out["anthropic_wrong_key"][0] == 401 and out["anthropic_wrong_key"][1]["type"] == "error"
        assert out["anthropic_wrong_key"][1]["error"]["type"] == "authentication_error"
        for name in ("bad_json", "deep_json", "not_object", "image", "n"):
            assert out[name][0] == 400 and "message" in out[name][1]["error"], (name, out[name])
        for name in ("too_big", "too_big_chunked"):
            assert out[name][0] == 413 and "max_request_bytes" in out[name][1]["error"]["message"], (
                name,
                out[name],
            )
        for name, status in (("unknown_api", 404), ("outside", 404), ("get", 405)):
            assert out[name][0] == status and out[name][1]["error"]["message"], (name, out[name])
        for name in ("unknown_api", "outside"):  # one line naming the routes the gateway serves
            assert "serves POST /sessions/{id}/v1/chat/completions" in out[name][1]["error"]["message"]
            assert "/v1/messages" in out[name][1]["error"]["message"]
        assert out["too_many"][0] == 400 and "max_messages (20)" in out["too_many"][1]["error"]["message"]
        assert out["ok"][0] == 200 and out["ok"][1]["choices"][0]["message"]["tool_calls"]
        assert traj.assistant_turns == 1  # only the good call reached the model
    assert len(backend.requests) == 2


async def diverge(call: HarnessCall) -> dict:
    out = {}
    status, first = await post(call, "chat/completions", chat(USER))
    assistant = first["choices"][0]["message"]
    tc = assistant["tool_calls"][0]
    good = {"role": "tool", "tool_call_id": tc["id"], "content": "3"}
    edited = dict(assistant, content="I changed my mind")
    out["edited_assistant"] = await post(call, "chat/completions", chat(USER, edited, good))
    out["compacted"] = await post(
        call, "chat/completions", chat({"role": "user", "content": "summary"}, good)
    )
    out["wrong_role"] = await post(call, "chat/completions", chat(USER, dict(assistant, role="user"), good))
    out["branch"] = await post(call, "chat/completions", chat(USER, assistant))
    out["other_tools"] = await post(
        call,
        "chat/completions",
        chat(
            USER,
            assistant,
            good,
            tools=[{"type": "function", "function": {"name": "x", "parameters": {"type": "object"}}}],
        ),
    )
    out["extends"] = await post(call, "chat/completions", chat(USER, assistant, good))
    return out


diverge_harness = harness(diverge, timeout_s=60)


def test_a_history_that_differs_is_never_merged(tmp_path, tokenizer):
    trajs, backend = run(
        spec(tmp_path, "tests.gateway.test_hostile:diverge_harness", "limits: {max_assistant_turns: 8}"),
        tokenizer,
        [row()],
    )
    traj = trajs[0]
    out = traj.extra["harness"]["result"]
    for name in ("edited_assistant", "compacted", "wrong_role", "other_tools", "extends"):
        assert out[name][0] == 200, (name, out[name])
    # a request ending on the model's own turn has nothing for the model to answer
    assert (
        out["branch"][0] == 400 and "ends with an assistant message" in out["branch"][1]["error"]["message"]
    )
    # each differing history is a segment of its own; "extends" answers the first turn's call: it goes on in that
    # turn's own row, the session's last (nothing copied)
    assert [s.reason for s in traj.segments] == ["history", "history", "history", "history", "prompt"]
    assert [r["node"] for r in traj.extra["tree"]] == ["0"] * 5  # none is a sub-agent: no answer came back
    assert traj.assistant_turns == 6 and len(backend.requests) == 6
    # nothing the edited requests carried reached the recorded turn's row
    assert "changed my mind" not in tokenizer.decode(traj.segments[-1].context_ids())
    assert "changed my mind" in tokenizer.decode(traj.segments[0].prompt_ids.tolist())


async def spin(call: HarnessCall) -> None:
    while True:  # ignores every error: only the gateway's limits end it
        await post(call, "chat/completions", chat(USER))


spin_harness = harness(spin, timeout_s=60)


def test_a_harness_that_spins_is_ended_by_the_limits(tmp_path, tokenizer):
    trajs, backend = run(
        spec(tmp_path, "tests.gateway.test_hostile:spin_harness", "limits: {max_assistant_turns: 1}"),
        tokenizer,
        [row()],
    )
    traj = trajs[0]
    assert traj.termination_reason == "harness_failed"
    assert traj.extra["harness"]["outcome"] == "spinning"
    assert "max_assistant_turns (1)" in traj.extra["harness"]["error"]
    assert traj.assistant_turns == 1 and len(backend.requests) == 1


async def limit_then_stop(call: HarnessCall) -> Any:
    from openai import AsyncOpenAI, BadRequestError

    client = AsyncOpenAI(base_url=call.base_url, api_key=call.api_key, max_retries=0)
    await client.chat.completions.create(model="m", messages=[USER])
    try:
        await client.chat.completions.create(model="m", messages=[USER])
    except BadRequestError as exc:  # the SDK's own error type: the harness can handle it
        return {"code": exc.code, "message": exc.message}
    finally:
        await client.close()


limit_harness = harness(limit_then_stop, timeout_s=60)


def test_a_call_past_a_limit_is_an_api_error_the_sdk_raises(tmp_path, tokenizer):
    extra("openai", "gateway")  # the harness is the openai SDK
    trajs, _ = run(
        spec(tmp_path, "tests.gateway.test_hostile:limit_harness", "limits: {max_assistant_turns: 1}"),
        tokenizer,
        [row()],
    )
    result = trajs[0].extra["harness"]["result"]
    assert result["code"] == "limit_reached" and "max_assistant_turns" in result["message"]
    assert trajs[0].termination_reason == "done"


async def hang(call: HarnessCall) -> None:
    await post(call, "chat/completions", chat(USER))
    await asyncio.Event().wait()


hang_harness = harness(hang, timeout_s=1.0)


def test_a_harness_that_hangs_ends_by_its_timeout(tmp_path, tokenizer):
    trajs, _ = run(spec(tmp_path, "tests.gateway.test_hostile:hang_harness"), tokenizer, [row()])
    assert trajs[0].extra["harness"]["outcome"] == "timeout"
    assert trajs[0].termination_reason == "harness_failed" and trajs[0].assistant_turns == 1


SCRIPT = """
import json, os, sys, urllib.request
req = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions",
    data=json.dumps({"model": "m", "messages": json.loads(os.environ["AGENTFSM_ROW"])["raw_prompt"]}).encode(),
    headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"], "Content-Type": "application/json"})
print(json.load(urllib.request.urlopen(req))["choices"][0]["finish_reason"])
if sys.argv[1] == "hang":
    import time; time.sleep(600)
sys.exit(int(sys.argv[1]) if sys.argv[1] != "hang" else 0)
"""
command_ok = harness(command=[sys.executable, "-c", SCRIPT, "0"], timeout_s=60)
command_fails = harness(command=[sys.executable, "-c", SCRIPT, "3"], timeout_s=60)
command_hangs = harness(command=[sys.executable, "-c", SCRIPT, "hang"], timeout_s=3)


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, outcome, code",
    [("command_ok", "exit", 0), ("command_fails", "exit", 3), ("command_hangs", "timeout", None)],
)
def test_a_command_harness(tmp_path, tokenizer, name, outcome, code):
    trajs, _ = run(spec(tmp_path, f"tests.gateway.test_hostile:{name}"), tokenizer, [row()])
    got = trajs[0].extra["harness"]
    assert got["outcome"] == outcome and got.get("exit_code") == code, got
    assert trajs[0].assistant_turns == 1
    if outcome == "exit":
        assert got["result"] == "tool_calls"
    assert trajs[0].termination_reason == ("done" if code == 0 else "harness_failed")


def test_sessions_are_bounded(tmp_path, tokenizer):
    gateway = Gateway(limits=GatewayLimits(max_sessions=1))
    trajs, _ = run(
        spec(tmp_path, "tests.gateway.test_hostile:hang_harness"), tokenizer, [row(), row()], gateway
    )
    errors = [t.error for t in trajs if t.error]
    assert len(errors) == 1 and "max_sessions (1)" in errors[0]


def test_the_cli_binds_loopback_by_default_and_validates_its_flags(capsys):
    from fsm.cli.commands import build_parser, main

    args = build_parser().parse_args(["gateway", "examples/gateway/base.yaml"])
    assert args.host == "127.0.0.1" and args.gateway_port == 0 and args.max_sessions == 10_000
    assert main(["gateway", "examples/gateway/base.yaml", "--max-sessions", "0"]) == 2
    assert "--max-sessions" in capsys.readouterr().err


def test_concurrent_first_uses_start_one_server():
    async def main() -> set[int]:
        gateway = Gateway()

        async def port() -> int:
            await gateway.start()
            return gateway.port

        try:
            return set(await asyncio.gather(*(port() for _ in range(20))))
        finally:
            await gateway.close()

    ports = asyncio.run(main())
    assert len(ports) == 1 and 0 not in ports  # every first user got the one server


command_orphans = harness(command=[sys.executable, str(Path(__file__).with_name("orphans.py"))], timeout_s=60)


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _none_left(out: Path, timeout_s: float = 30) -> None:
    """No process of the harness is alive, at once or within `timeout_s`: those the kernel kills with the harness's
    PID namespace may take a moment to die on a loaded machine."""
    deadline = time.monotonic() + timeout_s
    while left := _left(out):
        assert time.monotonic() < deadline, f"processes the harness left are alive: {left}"
        time.sleep(0.05)


def _left(out: Path) -> list[int]:
    """The live processes whose environment names `out` as their ORPHANS_DIR: what a harness of this test left.
    (Their own pids are of the harness's PID namespace, where the reaper contains it: not this process's.)"""
    mark = f"ORPHANS_DIR={out}".encode() + b"\0"
    left = []
    for entry in Path("/proc").iterdir():
        try:
            if (
                entry.name.isdigit()
                and mark in (entry / "environ").read_bytes()
                and _running(int(entry.name))
            ):
                left.append(int(entry.name))
        except OSError:
            continue
    return left


def test_a_harness_leaves_no_process_and_its_session_ends_with_it(tmp_path, tokenizer, monkeypatch):
    monkeypatch.setenv("ORPHANS_DIR", str(tmp_path))
    trajs, backend = run(spec(tmp_path, "tests.gateway.test_hostile:command_orphans"), tokenizer, [row()])
    got = trajs[0].extra["harness"]
    assert got["outcome"] == "exit" and got["exit_code"] == 0, got
    assert all((tmp_path / f"{name}.pid").exists() for name in ("group", "setsid"))
    _none_left(tmp_path)  # ended with the row, SIGTERM ignored
    for name in ("group", "setsid"):  # killed before it could call, or refused: never answered
        status = tmp_path / f"{name}.status"
        assert not status.exists() or status.read_text() in ("401", "400"), status.read_text()
    assert len(backend.requests) == 1 and trajs[0].assistant_turns == 1  # the late call was not recorded
    assert trajs[0].termination_reason == "done"


command_orphans_hangs = harness(
    command=[sys.executable, str(Path(__file__).with_name("orphans.py"))], timeout_s=5
)


@pytest.mark.slow
def test_a_harness_its_row_ends_leaves_no_process(tmp_path, tokenizer, monkeypatch):
    monkeypatch.setenv("ORPHANS_DIR", str(tmp_path))
    monkeypatch.setenv("ORPHANS_HANG", "1")
    trajs, backend = run(
        spec(tmp_path, "tests.gateway.test_hostile:command_orphans_hangs"), tokenizer, [row()]
    )
    assert trajs[0].extra["harness"]["outcome"] == "timeout", trajs[0].extra["harness"]
    assert all((tmp_path / f"{name}.pid").exists() for name in ("group", "setsid"))
    _none_left(tmp_path)
    assert len(backend.requests) == 1 and trajs[0].termination_reason == "harness_failed"


HUGE = "word " * 1_400_000  # 7 MiB of text: far past any prompt_length, under the 8 MiB request bound


async def huge_then_small(call: HarnessCall) -> Any:
    huge = await post(call, "chat/completions", chat({"role": "user", "content": HUGE}))
    small = await post(call, "chat/completions", chat(USER))
    return [huge, small[0]]


huge_harness = harness(huge_then_small, timeout_s=120)


def test_a_request_far_past_the_context_is_refused_before_it_is_tokenized(tmp_path, tokenizer, monkeypatch):
    """A ~7 MiB request was tokenized whole on the event loop (30 s, every session stalled, 3.4 GB): its text
    alone puts it past the spec's prompt_length, so it is refused before the codec renders or tokenizes it."""
    from fsm.families.codec import Codec

    sizes: list[int] = []
    encode = Codec.encode_prompt

    def measured(self, messages, *args, **kwargs):
        sizes.append(sum(len(str(m.get("content") or "")) for m in messages))
        return encode(self, messages, *args, **kwargs)

    monkeypatch.setattr(Codec, "encode_prompt", measured)
    trajs, _ = run(spec(tmp_path, "tests.gateway.test_hostile:huge_harness"), tokenizer, [row()])
    (status, body), small = trajs[0].extra["harness"]["result"]
    assert status == 400 and body["error"]["code"] == "context_length_exceeded", body
    assert (
        "the prompt is at least" in body["error"]["message"] and "prompt_length" in body["error"]["message"]
    )
    assert small == 200  # the session serves on
    assert sizes and max(sizes) < 1_000  # only the small request was rendered


# 170 KiB of distinct words: its floor (10,957 tokens: the tiny tokenizer's longest token is 16 bytes) is under a
# 16k prompt_length, its tokens are not, so only tokenizing it says so (~2-3 s on a loaded 2-core machine)
UNDER_FLOOR = " ".join(f"w{i % 99_991}x{i % 7}" for i in range(20_000))


async def large_while_ticking(call: HarnessCall) -> Any:
    """The large request, then a small one, while a task on the same loop measures how late its 10 ms sleeps wake."""
    late: list[float] = []

    async def tick() -> None:
        while True:
            t = time.perf_counter()
            await asyncio.sleep(0.01)
            late.append(time.perf_counter() - t - 0.01)

    ticker = asyncio.get_running_loop().create_task(tick())
    try:
        large = await post(call, "chat/completions", chat({"role": "user", "content": UNDER_FLOOR}))
        small = await post(call, "chat/completions", chat(USER))
    finally:
        ticker.cancel()
    return [large, small[0], max(late)]


large_harness = harness(large_while_ticking, timeout_s=120)


def test_a_request_under_the_floor_but_past_the_context_is_tokenized_off_the_loop(tmp_path, tokenizer):
    """A request whose text floor is under the spec's prompt_length is tokenized to learn it is past it: 170 KiB
    tokenized on the event loop stalled every session (a 10 ms sleep woke 2.3 s late; 1.7 MiB, 28.6 s). A large one
    is tokenized in a thread: the loop wakes 0.04 s late at most, and the request is refused in one line."""
    trajs, _ = run(
        spec(tmp_path, "tests.gateway.test_hostile:large_harness", "limits: {prompt_length: 16384}"),
        tokenizer,
        [row()],
    )
    (status, body), small, late = trajs[0].extra["harness"]["result"]
    assert status == 400 and body["error"]["code"] == "context_length_exceeded", body
    assert "past the spec's limits.prompt_length 16384" in body["error"]["message"], body
    assert small == 200  # the session serves on
    assert late < 0.25, f"the loop was blocked {late:.3f} s"


def test_a_body_is_read_and_written_as_json_reads_and_writes_it() -> None:
    """orjson reads and writes the gateway's JSON; what it would read otherwise (an integer past 64 bits as a
    float) or refuses (NaN, a lone surrogate) goes json's way, so a tool schema's numbers render as sent."""
    from fsm.gateway.server import SCAN_BELOW, _body, _json

    big = 123456789012345678901234
    assert _body(b'{"a": 123456789012345678901234, "b": "\\u00e9"}') == {"a": big, "b": "é"}
    assert _body(b'{"a": NaN}')["a"] != 0 and _body(b'{"s": "\\ud800"}') == {"s": "\ud800"}
    pad = "x" * SCAN_BELOW  # a body this large is checked in what orjson read, not in its bytes
    for n in (big, -(2**63) - 1, 2**64, 2**64 - 1, 7):
        assert _body(b'{"p": "%s", "a": [0.5, {"n": %d}]}' % (pad.encode(), n)) == {
            "p": pad,
            "a": [0.5, {"n": n}],
        }
        assert type(_body(b'{"p": "%s", "n": %d}' % (pad.encode(), n))["n"]) is int
    assert json.loads(_json({"a": big, "b": "é"}).body) == {"a": big, "b": "é"}  # type: ignore[arg-type]
