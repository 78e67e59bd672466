"""The gateway's HTTP side: an aiohttp server that serves each session under `/sessions/{id}/` (OpenAI Chat
Completions and Responses at `v1/chat/completions` and `v1/responses`, Anthropic Messages at `v1/messages`,
Gemini at `v1beta/models/{model}:generateContent` and `:streamGenerateContent`) and hands each model call to the trajectory that owns the session.

A session is opened by the harness state for one trajectory (fsm/gateway/harness.py) with a random id and a
random key; a request must carry that key (`Authorization: Bearer` as the OpenAI SDK sends it, or
`x-api-key` as the Anthropic SDK does, `x-goog-api-key` or `?key=` as Gemini's), so one session can never read or write another. The server only
parses data: bodies are bounded in bytes, messages and depth before anything else reads them, and nothing in
a request is executed or used as a path. Every refusal is an API error in the shape the caller's SDK reads.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import logging
import os
import secrets
import socket
import weakref
from collections import deque
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import orjson
from aiohttp import web

from fsm.gateway import anthropic_api, gemini_api, openai_api, peer
from fsm.gateway.record import AUX, AUX_PROMPTS, Answer, Call, GatewayError, auxiliary, prompt_kind
from fsm.gateway.tree import NAME, Tree, child_line
from fsm.run.engine import Owned, owned

log = logging.getLogger("agentfsm.gateway")
# a harness names a call that is not its agent's own turn: `x-agentfsm-call: title`
AUX_HEADER = "x-agentfsm-call"


async def listen(
    handler: Callable[[web.BaseRequest], Awaitable[web.StreamResponse]],
    host: str,
    port: int,
    sock: socket.socket | None = None,
) -> tuple[web.BaseRunner, int]:
    """Serve `handler` on host:port (0: any free port), or on `sock`, a socket bound already; the runner to close
    and the port it got. The gateway and its front (fsm/gateway/front.py) listen alike, on aiohttp's low-level
    server: every request goes to the one handler, which routes it (`route`), so no router, middleware chain or
    Application is run per request."""
    runner = web.ServerRunner(web.Server(handler, access_log=None), handle_signals=False)
    await runner.setup()
    site = web.SockSite(runner, sock) if sock is not None else web.TCPSite(runner, host, port)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]


@dataclass(frozen=True)
class GatewayLimits:
    """What one gateway accepts. Tokens per session are the spec's limits (prompt_length, response_length)."""

    max_request_bytes: int = 8 << 20
    max_messages: int = 4096
    max_sessions: int = 10_000
    max_refused_calls: int = 8  # calls past a limit one harness may make before its row is ended
    max_segments: int = 32  # segments per session: histories that differ from the recorded one start one each
    max_nodes: int = 64  # nodes of a session's tree: child sessions and branches (fsm/gateway/tree.py)
    max_depth: int = 4  # how deep a child session or a branch may be under the session
    # tools other than functions: "drop" (left out, noted on the row) or "refuse"
    unsupported_tools: str = "drop"
    # calls that are not the agent's own turns (a title, a compaction: record.auxiliary), each recorded on a node
    # of its own: "keep" (a row like any, node_kind its kind), "separate" (the same, its policy its kind, so a
    # trainer trains it apart) or "drop" (answered, left out of the rows)
    auxiliary_calls: str = "separate"
    auxiliary_prompts: tuple[tuple[str, str], ...] = AUX_PROMPTS  # (kind, text its system prompt holds)
    # headers that name the agent a call is of (Claude Code's sub-agents send x-claude-code-agent-id, opencode
    # each session's x-session-id, Codex each thread's thread-id): a value other than the session's first call's
    # is a sub-agent, recorded as a child session of its own (`Session.line`); a parent header names the agent
    # that started it (nesting)
    child_headers: tuple[str, ...] = ("x-claude-code-agent-id", "x-session-id", "thread-id")
    parent_headers: tuple[str, ...] = (
        "x-claude-code-parent-agent-id",
        "x-parent-session-id",
        "x-codex-parent-thread-id",
    )

    def __post_init__(self) -> None:
        if self.auxiliary_calls not in ("keep", "separate", "drop"):
            raise ValueError(f"auxiliary_calls {self.auxiliary_calls!r}: keep, separate or drop")


class SessionClosed(GatewayError):
    code = "session_closed"


class Session:
    """One trajectory's end of the gateway: its credentials, the model call waiting for the driver, and the
    recorded conversation. The HTTP side puts a call here; the harness state takes it (fsm/gateway/harness.py)."""

    def __init__(self, gateway: Gateway, traj_id: str):
        self.gateway = gateway
        raw = secrets.token_bytes(36)  # the id's 12 random bytes, the key's 24: one read of the OS's
        self.id = f"{gateway.tag}-{raw[:12].hex()}" if gateway.tag else raw[:12].hex()
        self.key = base64.urlsafe_b64encode(raw[12:]).decode()  # as secrets.token_urlsafe(24): 32 characters
        self.traj_id = traj_id
        limits = gateway.limits
        self.tree = Tree(limits.max_segments, limits.max_nodes, limits.max_depth, limits.auxiliary_calls)
        self.wake = asyncio.Event()  # a call arrived, or the harness ended
        # sent, not yet taken by the driver: one per line at most (the session and each child session)
        self.pending: deque[tuple[Call, asyncio.Future[Answer]]] = deque()
        # taken: the GENERATING state records it
        self.current: tuple[Call, asyncio.Future[Answer]] | None = None
        self.agents: dict[str, tuple[str, ...]] | None = None  # child header values -> their lines (`line`)
        self.notes: list[str] = []  # refusals of the tree (unknown parent, cycle, depth) for the row's record
        self.timer: asyncio.TimerHandle | None = None  # wakes the harness state at its deadline (harness.py)
        self.refused = 0
        self.last_refusal = "refused"  # the last refusal's message (harness.py)
        self.answered_errors = 0  # requests answered with an API error, whatever refused them
        self.first_error = ""  # the first of them: a row whose every call was refused names it (harness.py)
        self.task: asyncio.Task[Any] | None = None  # the harness's task (harness.py)
        self.calls = 0
        self.closed = False
        # a command harness's process, once started (harness.py refuses calls after it)
        self.pid: int | None = None
        # the process whose tree every request must come from (its harness's reaper, or this process for a function
        # harness; fsm/gateway/peer.py); None: the key alone (a session opened by hand, or no /proc)
        self.owner: int | None = None
        self.peers: set[int] = set()  # the connections' socket inodes found in the owner's tree
        self._system: tuple[list[str], str | None] | None = None  # the last call's system prompts, their kind

    @property
    def base_url(self) -> str:
        """The OpenAI SDK's base_url (`.../v1`); the Anthropic SDK takes `anthropic_base_url`."""
        return f"{self.gateway.public_url}/sessions/{self.id}/v1"

    @property
    def anthropic_base_url(self) -> str:
        return f"{self.gateway.public_url}/sessions/{self.id}"  # a child session's: + /child/{name}

    async def submit(self, call: Call) -> Answer:
        if self.closed:
            raise SessionClosed("the session has ended (its row is finished)")
        try:
            self.tree.check_line(call.child)
        except GatewayError as exc:
            self.note(str(exc))
            raise
        if len(self.pending) >= self.tree.max_nodes:
            # calls wait their turn, in order: sub-agents run in parallel, each on a node of its own (tree.py)
            raise GatewayError(
                f"the session has {len(self.pending)} model calls waiting, its max_nodes: one trajectory "
                "takes one call at a time",
                code="session_busy",
            )
        future: asyncio.Future[Answer] = asyncio.get_running_loop().create_future()
        entry = (call, future)
        self.pending.append(entry)
        self.calls += 1
        self.wake.set()
        try:
            return await future
        finally:
            if entry in self.pending:
                self.pending.remove(entry)  # the caller went away before the driver took it

    def line(self, headers: Any) -> tuple[str, ...]:
        """The child session a call on the session's own URL is of, from the headers that name its agent
        (GatewayLimits.child_headers): the agent of the session's first call is the session itself; any other
        value is a sub-agent, a child of the agent its parent header names (the session, if none)."""
        limits = self.gateway.limits
        values = {h: headers.get(h) for h in (*limits.child_headers, *limits.parent_headers)}
        if self.agents is None:  # the first call: its agent is the session's own
            self.agents = {v: () for v in values.values() if v}
            return ()
        agent = next((v for h in limits.child_headers if (v := values[h])), None)
        if agent is None:
            return ()
        if agent in self.agents:
            return self.agents[agent]
        parent = next((values[h] for h in limits.parent_headers if values[h] in self.agents), None)
        name = agent if NAME.fullmatch(agent) else "h" + hashlib.sha256(agent.encode()).hexdigest()[:16]
        self.agents[agent] = line = (*self.agents.get(parent, ()), name)  # type: ignore[arg-type]
        return line

    def system_kind(self, system: list[str], prompts: tuple[tuple[str, str], ...]) -> str | None:
        """record.prompt_kind, kept for the system prompts the session's last call sent: a harness sends the same
        with every call, and looking for each of `prompts` in them is O(their length), comparing them is less."""
        if self._system is None or self._system[0] != system:
            self._system = (system, prompt_kind(system, prompts))
        return self._system[1]

    def take(self) -> tuple[Call, asyncio.Future[Answer]]:
        """The driver takes the first waiting call: from now on it is the current one."""
        self.current = self.pending.popleft()
        return self.current

    def note(self, line: str) -> None:
        """A refusal the row's record keeps (`gateway_notes`), once each, at most 32."""
        if line not in self.notes and len(self.notes) < 32:
            self.notes.append(line)

    def close(self, reason: str = "the session has ended (its row is finished)") -> None:
        """End the session: a call still waiting gets an error; the id and key stop working."""
        self.closed = True
        for entry in (*self.pending, self.current):
            if entry is not None and not entry[1].done():
                entry[1].set_exception(SessionClosed(reason))
        self.pending.clear()
        self.current = None
        self.gateway.sessions.pop(self.id, None)
        self.gateway.harnesses.discard(self.owner or 0)
        self.wake.set()


class Gateway:
    """The HTTP server and its sessions. One per backend: `attach` makes it the one harness states of runs
    over that backend use; a run without one gets a loopback gateway started on first use."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        limits: GatewayLimits | None = None,
        *,
        tag: str = "",
        front: str | None = None,
        sock: socket.socket | None = None,
    ):
        """`tag` and `front`: one worker of several behind a front (fsm/gateway/front.py): its session ids start
        with `tag-` (the front routes by it) and its harnesses are given the front's URL. `sock`: a socket bound
        already, to listen on (a worker registers its port with the front before its engine starts,
        fsm/gateway/workers.py)."""
        if "-" in tag or "/" in tag:
            raise ValueError(f"a gateway's tag {tag!r} cannot hold '-' or '/'")
        self.host, self.port, self.tag, self.front, self.sock = host, port, tag, front, sock
        if sock is not None:
            self.port = sock.getsockname()[1]
        self.limits = limits or GatewayLimits()
        self.sessions: dict[str, Session] = {}
        self._runner: web.BaseRunner | None = None
        self._starting: asyncio.Future[None] | None = None  # the first start(); concurrent callers await it
        # per connection: its peer's socket inode, and whether that peer is this worker's front (fsm/gateway/peer.py)
        self._conns: weakref.WeakKeyDictionary[Any, tuple[int | None, bool, set[int]]] = (
            weakref.WeakKeyDictionary()
        )
        self._holders = peer.Holders()  # which process holds which peer socket (fsm/gateway/peer.py)
        self.harnesses: set[int] = set()  # command harnesses' reapers (not a function harness's tree)

    @property
    def url(self) -> str:
        host = self.host if self.host not in ("0.0.0.0", "::", "") else "127.0.0.1"
        return f"http://{host}:{self.port}"

    @property
    def public_url(self) -> str:
        """Where harnesses reach it: the front's URL when it is one worker behind a front."""
        return self.front or self.url

    async def start(self) -> Gateway:
        """Listen (once: every caller after the first awaits the first's start)."""
        if self._runner is not None:
            return self
        if self._starting is not None:
            await asyncio.shield(self._starting)
            return self
        self._starting = asyncio.get_running_loop().create_future()
        try:
            self._runner, self.port = await listen(self._serve, self.host, self.port, self.sock)
        except BaseException as exc:
            self._starting.set_exception(exc)
            self._starting.exception()  # retrieved: a failed start is reported to each caller, never logged
            self._starting = None
            raise
        self._starting.set_result(None)
        return self

    async def close(self) -> None:
        for session in list(self.sessions.values()):
            session.close("the gateway is shutting down")
        if self._runner is not None:
            runner, self._runner, self._starting = self._runner, None, None
            await runner.cleanup()

    aclose = close  # as the engine that owns it closes it (fsm/run/engine.py `Owned`)

    async def __aenter__(self) -> Gateway:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def attach(self, owner: Owned) -> Gateway:
        """Harness states of the runs `owner` serves (an engine's services, fsm/run/engine.py `Owned`) use this
        gateway, which closes with them. An engine has one gateway: a second is refused."""
        if owner.get("gateway", lambda: self) is not self:
            raise ValueError("this engine has a gateway already: serve() one gateway per engine")
        return self

    def open(self, traj_id: str) -> Session:
        if len(self.sessions) >= self.limits.max_sessions:
            raise GatewayError(
                f"the gateway holds {len(self.sessions)} sessions, its max_sessions "
                f"({self.limits.max_sessions})",
                code="too_many_sessions",
                status=429,
            )
        session = Session(self, traj_id)
        self.sessions[session.id] = session
        return session

    # --- HTTP -----------------------------------------------------------------------------------------------

    async def _serve(self, request: web.BaseRequest) -> web.StreamResponse:
        session: Session | None = None
        try:
            sid, api, line, model = route(request, APIS)
            found = self._session(request, sid)
            self._from_owner(request, found)  # an intruder's refusal is not counted on the row
            session = found
            if api == "models":
                return _json(
                    {
                        "object": "list",
                        "data": [{"id": "agentfsm", "object": "model", "owned_by": "agentfsm"}],
                    }
                )
            parse, answer, stream = APIS[api][1]  # type: ignore[misc]
            body = _body(await read_body(request, self.limits.max_request_bytes))
            call = parse(body)
            if model is not None:  # Gemini names the model in the path
                call.extra["model"] = model
            # a child session's path, else a harness's sub-agent on the session's own URL, named by a header
            call.child = line or session.line(request.headers)
            kind = auxiliary(
                call, request.headers.get(AUX_HEADER), self.limits.auxiliary_prompts, session.system_kind
            )
            if kind is not None:  # not the agent's own turn: a node of its own, beside the line's (tree.py)
                call.child += (AUX + kind,)
            if call.extra.get("dropped_tools") and self.limits.unsupported_tools == "refuse":
                raise GatewayError(
                    f"{call.extra['dropped_tools'][0]}: only function tools are supported (the "
                    "gateway's unsupported_tools is 'refuse')",
                    code="unsupported_tool",
                )
            if len(call.messages) > self.limits.max_messages:
                raise GatewayError(
                    f"{len(call.messages)} messages, past the gateway's max_messages "
                    f"({self.limits.max_messages})",
                    code="too_many_messages",
                )
            result = await session.submit(call)
            if not call.stream:
                return _json(answer(result, call, session.id))
            if model is not None and request.query.get("alt") != "sse":  # Gemini without SSE: one array
                return _json(gemini_api.stream_chunks(result, call, session.id))
            return await _sse(request, stream(result, call, session.id))
        except GatewayError as exc:
            if session is not None:  # parsing, a limit, the tree, recording
                session.answered_errors += 1
                session.first_error = session.first_error or f"{exc.status} {exc.code}: {exc}"
            return _error(request, exc)

    def _session(self, request: web.BaseRequest, sid: str) -> Session:
        session = self.sessions.get(sid)
        auth = request.headers.get("Authorization", "")
        key = (
            (auth[7:] if auth.startswith("Bearer ") else "")
            or request.headers.get("x-api-key")
            or request.headers.get("x-goog-api-key")  # Gemini's SDK, or its `?key=`
            or request.query.get("key", "")
        )
        if session is None or not hmac.compare_digest(key.encode(), session.key.encode()):
            raise GatewayError("unknown session, or not its key", code="invalid_api_key", status=401)
        return session

    def _from_owner(self, request: web.BaseRequest, session: Session) -> None:
        """Refuse a request of a bound session whose connection no process of its harness holds: its key was
        learned by another process (fsm/gateway/peer.py). Looked up once per connection and harness: a kept-alive
        connection that a harness's tree was found holding serves that harness's later sessions unchecked."""
        if session.owner is None:
            return
        inode, owners = self._peer_socket(request)
        if inode is not None and (inode in session.peers or session.owner in owners):
            return
        me = os.getpid()
        # a function harness runs in this process: any process of ours but another session's command harness
        skip = self.harnesses if session.owner == me else ()
        if inode is None or not self._held(session.owner, skip, inode):
            whose = "this process's" if session.owner == me else f"process {session.owner}'s"
            session.note("a request with this session's key came from another process, refused")
            raise GatewayError(
                f"this request comes from a process outside the session's harness ({whose} tree): a session's key "
                "is accepted only from the harness it was given to",
                code="not_the_sessions_process",
                status=403,
            )
        session.peers.add(inode)
        owners.add(session.owner)

    def _held(self, owner: int, skip: Any, inode: int) -> bool:
        """Whether a process of `owner`'s tree (less `skip`'s) holds socket `inode`: the process seen holding it
        first (it still holds it, and is of this tree), else a walk of the tree's open files (peer.Holders)."""
        last = self._holders.at.get(inode)
        if last is not None and self._holders.holds(*last, inode) and peer.descends(last[0], owner, skip):
            return True
        found = self._holders.find(peer.tree(owner, skip), inode)
        return (found or self._holders.find(peer.tree(owner, skip), inode, again=True)) is not None

    def _peer_socket(self, request: web.BaseRequest) -> tuple[int | None, set[int]]:
        """The inode of the socket the request came over: its caller's, or behind a front, the socket the front
        names (PEER_HEADER), believed only over a connection of the front (this worker's parent process); and
        the harnesses (owners) found holding the connection (always empty behind a front: each request names its
        own socket)."""
        transport = request.transport
        if transport is None:
            return None, set()
        known = self._conns.get(transport)
        if known is None:
            inode = peer.socket_inode(
                transport.get_extra_info("peername"), transport.get_extra_info("sockname")
            )
            front = bool(self.front and inode is not None and self._holders.find([os.getppid()], inode, True))
            self._conns[transport] = known = (inode, front, set())
        if not known[1]:
            return known[0], known[2]
        named = request.headers.get(peer.PEER_HEADER, "")
        return int(named) if named.isdigit() else None, set()


# what each API path under /sessions/{id}/v1/ takes: its method, and (request -> Call, answer, SSE events)
APIS: dict[str, tuple[str, tuple[Callable[..., Any], ...] | None]] = {
    "chat/completions": ("POST", (openai_api.chat_call, openai_api.chat_answer, openai_api.chat_stream)),
    "responses": (
        "POST",
        (openai_api.responses_call, openai_api.responses_answer, openai_api.responses_stream),
    ),
    "messages": (
        "POST",
        (anthropic_api.messages_call, anthropic_api.messages_answer, anthropic_api.messages_stream),
    ),
    "models": ("GET", None),
    gemini_api.PREFIX + "{model}:generateContent": (
        "POST",
        (gemini_api.generate_call, gemini_api.generate_answer, gemini_api.generate_stream),
    ),
    gemini_api.PREFIX + "{model}:streamGenerateContent": (
        "POST",
        (
            partial(gemini_api.generate_call, stream=True),
            gemini_api.generate_answer,
            gemini_api.generate_stream,
        ),
    ),
}


def _not_found(path: str, apis: dict[str, Any]) -> GatewayError:
    """The one line a harness gets on a path no session serves, naming the routes that are (a harness pointed at an
    API the gateway does not speak learns what to point it at)."""
    routes = ", ".join(
        f"{method} /sessions/{{id}}/{'' if api.startswith(gemini_api.PREFIX) else 'v1/'}{api}"
        for api, (method, _) in apis.items()
    )
    return GatewayError(f"no API at {path[:200]}: this gateway serves {routes}", code="not_found", status=404)


def route(
    request: web.BaseRequest, apis: dict[str, Any] | None = None
) -> tuple[str, str, tuple[str, ...], str | None]:
    """(session id, API path, child line, Gemini's model) of `/sessions/{id}[/child/{name}...]/v1/{api}`, read
    once per request; the API checked against `apis` and its method when given (else the path after the id).
    Anything else is a 404 naming the routes served (405: a known path, another method) in the API's error
    shape."""
    parts = request.path.split("/", 3)
    if len(parts) < 4 or parts[0] or parts[1] != "sessions" or not parts[2]:
        raise _not_found(request.path, apis or APIS)
    sid, tail = parts[2], parts[3]
    if apis is None:
        return sid, tail, (), None
    line, tail = child_line(tail)  # a child session's path (fsm/gateway/tree.py) serves the same APIs
    gemini = gemini_api.split_path(tail)
    api = (
        f"{gemini_api.PREFIX}{{model}}:{gemini[0]}" if gemini else tail[3:] if tail.startswith("v1/") else ""
    )
    if api not in apis:
        raise _not_found(request.path, apis)
    if request.method != apis[api][0]:
        raise GatewayError("Method Not Allowed", code="http_error", status=405)
    return sid, api, line, gemini[1] if gemini else None


async def read_body(request: web.BaseRequest, limit: int) -> bytes:
    """The request body, refused with 413 as soon as it is past `limit` bytes (declared or streamed)."""
    if (request.content_length or 0) > limit:
        raise _too_large(limit)
    if request.content.is_eof() and request.content_length is not None:  # it came whole: no read loop
        return request.content.read_nowait()
    body = bytearray()
    async for chunk in request.content.iter_any():
        body += chunk
        if len(body) > limit:
            raise _too_large(limit)
    return bytes(body)


def _too_large(limit: int) -> GatewayError:
    return GatewayError(
        f"the request is larger than the gateway's max_request_bytes ({limit})",
        code="request_too_large",
        status=413,
    )


# each byte a digit ('0') or not (','): a run of 19 '0's may be an integer orjson reads as a float (json as an int)
_DIGITS = bytes(48 if 48 <= b <= 57 else 44 for b in range(256))
# from this size a body is checked for such an integer in what orjson read (O(values)), not in its bytes (O(bytes)):
# a long prompt is one value of many bytes
SCAN_BELOW = 1 << 15


def _as_float(value: Any) -> bool:
    """Whether `value` holds a float of magnitude 2**63 or more: only there can orjson have read an integer that
    json reads exactly (an integer past 64 bits, which orjson reads as a float)."""
    stack = [value]
    while stack:
        v = stack.pop()
        if type(v) is dict:
            stack.extend(v.values())
        elif type(v) is list:
            stack.extend(v)
        elif type(v) is float and not -(2.0**63) < v < 2.0**63:
            return True
    return False


def _body(raw: bytes) -> dict[str, Any]:
    """The request's JSON: orjson's reading (~3x json's), json's for what orjson refuses (NaN, bad UTF-8, past
    its depth) or may read otherwise (an integer of 19 digits or more) and for the refusal's words."""
    try:
        if len(raw) < SCAN_BELOW:
            body = None if b"0" * 19 in raw.translate(_DIGITS) else orjson.loads(raw)
        else:
            body = orjson.loads(raw)
            body = None if _as_float(body) else body
    except orjson.JSONDecodeError:
        body = None
    try:
        body = json.loads(raw) if body is None else body
    except (ValueError, RecursionError) as exc:
        raise GatewayError(f"the body is not valid JSON: {str(exc)[:200]}") from None
    if not isinstance(body, dict):
        raise GatewayError("the body must be a JSON object")
    return body


async def gateway_for() -> Gateway:
    """The running engine's gateway (fsm/run/engine.py `owned`): the one attached to it (`serve`, `agentfsm
    gateway`), else a loopback one on a free port; started now if need be, closed with the engine, shared with no
    other engine."""
    gateway = owned().get("gateway", Gateway)
    if gateway._runner is None:
        await gateway.start()
        log.info("gateway listening on %s (sessions under /sessions/{id}/v1)", gateway.url)
    return await gateway.start()


def _json(data: Any, status: int = 200) -> web.Response:
    try:
        body = orjson.dumps(data)  # ~15x json's
    except TypeError:  # an integer past 64 bits, a lone surrogate: json's
        body = json.dumps(data, ensure_ascii=False).encode()
    return web.Response(body=body, status=status, content_type="application/json")


def _error(request: web.BaseRequest, exc: GatewayError) -> web.Response:
    if request.path.endswith("/v1/messages"):
        return _json(anthropic_api.anthropic_error(exc), exc.status)
    if "/v1beta/" in request.path:
        return _json(gemini_api.gemini_error(exc), exc.status)
    return _json(openai_api.openai_error(exc), exc.status)


async def _sse(request: web.BaseRequest, events: Iterator[bytes]) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    for event in events:
        await response.write(event)
    await response.write_eof()
    return response
