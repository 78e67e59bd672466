"""Stand-ins for a model in engine tests and benchmarks: a backend that replays scripted token sequences,
deterministic toy models (`echo_backend`, `HashLM`), and scripted dev servers in subprocesses.

A script maps each session to its turns: the token ids the "model" emits on its 1st, 2nd, ... call.
It honours `max_new_tokens` and `stop_token_ids` the way SGLang does (a matched stop id is returned as the
last token; a cut at `max_new_tokens` reports finish reason "length"), so the engine meets the same edge
cases as with a real server.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
import zlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from backends.base import BackendUnavailable, BaseBackend, GenerateRequest, GenerateResult

# Returns the turn's token ids given (session_id, turn index, prompt ids); raise to simulate a failure.
TurnFn = Callable[[str, int, list[int]], Sequence[int]]


class ScriptedBackend(BaseBackend):
    provider = "scripted"

    def __init__(
        self,
        script: dict[str, Sequence[Sequence[int]]] | TurnFn,
        *,
        logprob: float | Callable[[int, int], float] = -0.5,
        latency_s: float = 0.0,
        model_name: str = "scripted",
        context_length: int | None = None,
        record_requests: bool = True,  # False for a long-lived server, which must not grow a request list
    ):
        self._script = script
        self._logprob = logprob
        self._latency_s = latency_s
        self._turns: dict[str, int] = {}
        self.model_name = model_name
        self.context_length = context_length
        self.requests: list[GenerateRequest] = []  # every request seen, for assertions
        self.record_requests = record_requests

    def _turn_ids(self, request: GenerateRequest, turn: int) -> Sequence[int]:
        if callable(self._script):
            return self._script(request.session_id, turn, request.prompt_ids)
        turns = self._script.get(request.session_id)
        if turns is None:
            # Fall back to a script keyed by the row part of "row/sample" session ids.
            turns = self._script.get(request.session_id.split("/", 1)[0])
        if turns is None or turn >= len(turns):
            raise BackendUnavailable(f"script has no turn {turn} for session {request.session_id!r}")
        return turns[turn]

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        if self.record_requests:
            self.requests.append(request)
        turn = self._turns.get(request.session_id, 0)
        self._turns[request.session_id] = turn + 1
        if self._latency_s:
            await asyncio.sleep(self._latency_s)
        ids = list(self._turn_ids(request, turn))
        params = request.sampling_params
        stops = set(params.get("stop_token_ids") or ())
        ids = ids[: next((i + 1 for i, tok in enumerate(ids) if tok in stops), len(ids))]  # through a stop id
        finish = "stop"
        limit = params.get("max_new_tokens")
        if limit is not None and len(ids) > limit:
            ids, finish = ids[:limit], "length"
        if callable(self._logprob):
            logprobs = [self._logprob(turn, i) for i in range(len(ids))]
        else:
            logprobs = [self._logprob] * len(ids)
        return GenerateResult(
            token_ids=ids,
            logprobs=logprobs if request.return_logprob else None,
            finish_reason=finish,
            prompt_tokens=len(request.prompt_ids),
            cached_tokens=0,
            server=self.model_name,
        )

    async def release(self, session_id: str) -> None:
        self._turns.pop(session_id, None)


# -- deterministic stand-ins for a model ------------------------------------------------------------


def echo_backend(
    *, length: int = 8, vocab: int = 512, eos: int = 2, latency_s: float = 0.0
) -> ScriptedBackend:
    """A deterministic function of the prompt: `length` ids derived from a CRC of the prompt, then `eos`.
    The default ids are plain tokens of the tiny tokenizer, so its answers pass the client's vocabulary check
    (backends/answer.py) over HTTP. The same prompt gives the same answer on every server and in every process,
    so a session's turns are reproducible wherever the router sends them.
    """

    def turn(session_id: str, turn: int, prompt: list[int]) -> list[int]:
        seed = zlib.crc32(b",".join(str(t).encode() for t in prompt))
        return [10 + (seed + 7919 * k) % (vocab - 10) for k in range(length)] + [eos]

    return ScriptedBackend(turn, latency_s=latency_s, model_name="echo", record_requests=False)


_QUESTION = re.compile(r"What is ([-+*/%() 0-9.]+)\?")
_RESULT = re.compile(r"<tool_response>\s*(.*?)\s*</tool_response>", re.S)


def calculator_backend(folder: str, *, latency_s: float = 0.0) -> ScriptedBackend:
    """The calculator's real turns (specs/calculator.yaml), answered at once: a calculator call on the question,
    then, once its result is in the prompt, "The answer is N.\n#### N", as the tiny model writes them in its
    template's tool-call format, over the tokenizer in `folder` (its tokenizer.json alone: no transformers). Only
    the prompt's tail is decoded, so the server stays faster than a client: `agentfsm bench engines` measures
    the client's cost per call on a real agent's turn shape with it (the echo model's is the cheapest)."""
    from tokenizers import Tokenizer

    with open(os.path.join(folder, "tokenizer_config.json"), encoding="utf-8") as f:
        eos_token = json.load(f)["eos_token"]
    with open(os.path.join(folder, "tokenizer.json"), encoding="utf-8") as f:
        tokenizer = Tokenizer.from_str(f.read())
    eos = tokenizer.token_to_id(eos_token["content"] if isinstance(eos_token, dict) else eos_token)
    if eos is None:
        raise ValueError(f"the eos_token {eos_token!r} is not in the vocabulary")

    def turn(session_id: str, turn: int, prompt: list[int]) -> list[int]:
        tail = tokenizer.decode(prompt[-48:], skip_special_tokens=False)
        if result := _RESULT.findall(tail):
            text = f"The answer is {result[-1]}.\n#### {result[-1]}"
        else:
            found = _QUESTION.findall(tail)
            expression = json.dumps({"expression": found[-1] if found else "0"})
            text = f'<tool_call>\n{{"name": "calculator", "arguments": {expression}}}\n</tool_call>'
        return [*tokenizer.encode(text, add_special_tokens=False).ids, eos]

    return ScriptedBackend(turn, latency_s=latency_s, model_name="calculator", record_requests=False)


class HashLM(BaseBackend):
    """A deterministic autoregressive toy language model: each token (and its logprob) is a hash of everything
    before it, prompt included. A generation aborted and resumed from its partial output therefore goes on
    exactly as the uninterrupted one would have, as greedy decoding does, and different prompts get different
    answers: the stand-in for a model in resume and failover tests. Turns end with `eos` after about
    `stop_every` tokens on average."""

    provider = "scripted"

    def __init__(
        self,
        *,
        vocab: int = 1000,
        eos: int = 2,
        stop_every: int = 8,
        latency_s: float = 0.0,
        per_token_s: float = 0.0,
        model_name: str = "hashlm",
    ):
        self.vocab, self.eos, self.stop_every = vocab, eos, stop_every
        self.latency_s, self.per_token_s = latency_s, per_token_s
        self.model_name = model_name
        self.context_length = None

    @staticmethod
    def _hash(ids: Sequence[int], h: int = 0) -> int:
        return zlib.crc32(b"".join(t.to_bytes(4, "little", signed=True) for t in ids), h)

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        params = request.sampling_params
        max_new = params.get("max_new_tokens")
        max_new = 128 if max_new is None else int(max_new)
        stops = {self.eos, *(params.get("stop_token_ids") or ())}
        h = self._hash(request.prompt_ids)
        ids: list[int] = []
        logprobs: list[float] = []
        finish = "length"
        while len(ids) < max_new:
            token = self.eos if (h >> 3) % self.stop_every == 0 else 10 + (h >> 7) % (self.vocab - 10)
            ids.append(token)
            logprobs.append(-((h >> 11) % 1000) / 1000.0 - 0.001)
            h = self._hash((token,), h)
            if token in stops:
                finish = "stop"
                break
        if self.latency_s or self.per_token_s:
            await asyncio.sleep(self.latency_s + self.per_token_s * len(ids))
        return GenerateResult(
            ids,
            logprobs if request.return_logprob else None,
            finish,
            prompt_tokens=len(request.prompt_ids),
            cached_tokens=0,
            server=self.model_name,
        )


# -- a scripted tool-calling model over a real tokenizer ----------------------------------------------------

# A harness's write-file tool, by the name it gives it: (path field, content field). Claude Code's `Write`,
# qwen-code's and Gemini CLI's `write_file`, opencode's `write`.
WRITE_TOOLS = {
    "Write": ("file_path", "content"),
    "write_file": ("file_path", "content"),
    "write": ("filePath", "content"),
}
# A harness's sub-agent tool, by the name it gives it: the arguments a call takes besides `description` and
# `prompt`. Claude Code's `Agent`, opencode's `task`, qwen-code's `agent`; Codex's `spawn_agent` (its namespace's,
# as the gateway renders it) takes the task as `message` alone, and its `wait_agent` the ids spawning returned.
CODEX_SPAWN = "multi_agent_v1__spawn_agent"
AGENT_TOOLS: dict[str, dict[str, Any]] = {
    "Agent": {"subagent_type": "general-purpose"},
    "Task": {"subagent_type": "general-purpose"},
    "task": {"subagent_type": "general"},
    "agent": {"subagent_type": "general-purpose"},
    CODEX_SPAWN: {},
}
_AGENT_ID = re.compile(r'"agent_id":\s*"([^"]+)"')
DEFAULT_TOOL_SCRIPT: list[dict[str, Any]] = [
    {"write": {"path": "hello.txt", "content": "hi\n"}},
    {"text": "Done."},
]
# A harness's model router (Gemini CLI's two classifiers), by a field its JSON schema requires: the answer that
# keeps the model it would use anyway, so the router is one call a turn, not five retries (docs/gateway.md).
ROUTER_ANSWERS: dict[str, dict[str, Any]] = {
    '"model_choice"': {"reasoning": "A scripted model keeps the default model.", "model_choice": "pro"},
    '"complexity_score"': {
        "complexity_reasoning": "A scripted model keeps the default model.",
        "complexity_score": 100,
    },
}
# where a coding harness says it works (qwen-code: "I'm currently working in the directory: /...")
_WORKDIR = re.compile(r"[Ww]orking (?:in the )?directory: (/[^\s<]+)")


def _step(step: Any) -> bool:
    """Whether `step` is one of a tool script's five kinds."""
    if not isinstance(step, dict) or len(step.keys() & {"write", "call", "text", "agents", "wait"}) != 1:
        return False
    if "write" in step:
        return isinstance(step["write"], dict)
    if "agents" in step:
        agents = step["agents"]
        return (
            isinstance(agents, list)
            and bool(agents)
            and all(
                isinstance(a, dict)
                and {"prompt", "answer"} <= {k for k, v in a.items() if isinstance(v, str)}
                for a in agents
            )
        )
    if "call" in step:
        return isinstance(step["call"], str) and isinstance(step.get("arguments", {}), dict)
    return isinstance(step.get("text", step.get("wait")), str)


class ToolScript:
    """A scripted tool-calling model (a `TurnFn` for ScriptedBackend) whose turns are real text of a real tokenizer
    in its chat template's tool-call format, so a gateway in front of it parses the calls and a harness runs them:
    real-size harness requests served on CPU at once. The steps and how a turn picks one: docs/gateway.md."""

    def __init__(self, tokenizer: Any, steps: Sequence[dict[str, Any]] | None = None):
        self.tokenizer = tokenizer
        self.steps = list(steps or DEFAULT_TOOL_SCRIPT) if isinstance(steps, list | None) else []
        if not self.steps or not all(map(_step, self.steps)):
            raise ValueError(
                'a tool script is a non-empty list of steps, each {"write": {"path", "content"}}, '
                '{"call": NAME, "arguments": {...}}, {"text": TEXT}, {"agents": [{"prompt", "answer"}, ...]} or {"wait": NAME}'
            )
        self.final = next((s["text"] for s in reversed(self.steps) if "text" in s), "Done.")
        self.agents = [a for s in self.steps for a in s.get("agents", ())]
        user = [{"role": "user", "content": "x"}]
        bare = tokenizer.apply_chat_template(user, tokenize=False)
        self._before = tokenizer.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
        self.header = self._before[len(bare) :] if self._before.startswith(bare) else ""
        if not self.header.strip():
            raise ValueError(
                "the tokenizer's chat template has no generation prompt: the scripted model cannot count turns"
            )

    @classmethod
    def from_file(cls, tokenizer: Any, path: str) -> ToolScript:
        with open(path, encoding="utf-8") as f:
            return cls(tokenizer, json.load(f))

    def _message(self, step: dict[str, Any], prompt: str) -> dict[str, Any]:
        if "text" in step:
            return {"role": "assistant", "content": str(step["text"])}
        if "agents" in step:
            found = next((n for n in AGENT_TOOLS if re.search(rf'"name":\s*"{n}"', prompt)), None)
            if found is None:
                return {"role": "assistant", "content": self.final}
            calls = [
                {"message": a["prompt"]}
                if found == CODEX_SPAWN
                else {"description": f"sub-agent {k}", "prompt": a["prompt"], **AGENT_TOOLS[found]}
                for k, a in enumerate(step["agents"])
            ]
            return {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {"type": "function", "function": {"name": found, "arguments": a}} for a in calls
                ],
            }
        if "wait" in step:
            step = {
                "call": step["wait"],
                "arguments": {"targets": list(dict.fromkeys(_AGENT_ID.findall(prompt)))},
            }
        if "write" in step:
            found = next((n for n in WRITE_TOOLS if re.search(rf'"name":\s*"{n}"', prompt)), None)
            if found is None:
                return {"role": "assistant", "content": self.final}
            path, content = WRITE_TOOLS[found]
            where = str(step["write"].get("path", "hello.txt"))
            workdir = _WORKDIR.search(prompt)
            if not os.path.isabs(where) and workdir is not None:
                where = os.path.join(workdir.group(1), where)
            name, arguments = found, {path: where, content: str(step["write"].get("content", ""))}
        else:
            name, arguments = str(step["call"]), dict(step.get("arguments") or {})
            if not re.search(rf'"name":\s*"{re.escape(name)}"', prompt):
                return {"role": "assistant", "content": self.final}
        call = {"type": "function", "function": {"name": name, "arguments": arguments}}
        return {"role": "assistant", "content": "", "tool_calls": [call]}

    def turn_text(self, prompt: str) -> str:
        """The text of the model's next turn after `prompt` (decoded, special tokens kept)."""
        k = max(0, prompt.count(self.header.strip()) - 1)  # the assistant turns before this one
        agent = next((a for a in self.agents if k == 0 and a["prompt"] in prompt), None)
        router = next((answer for field, answer in ROUTER_ANSWERS.items() if field in prompt), None)
        if router is not None:  # a model router's request: the JSON it asks for
            message: dict[str, Any] = {"role": "assistant", "content": json.dumps(router)}
        elif agent is not None:  # a sub-agent's conversation: its answer, at once
            message = {"role": "assistant", "content": agent["answer"]}
        else:
            message = self._message(self.steps[min(k, len(self.steps) - 1)], prompt)
        user = [{"role": "user", "content": "x"}]
        full = self.tokenizer.apply_chat_template([*user, message], tokenize=False)
        if not full.startswith(self._before):
            raise ValueError(
                "the chat template renders an assistant turn that does not follow its generation prompt"
            )
        return full[len(self._before) :]

    def __call__(self, session_id: str, turn: int, prompt: list[int]) -> list[int]:
        """The turn's ids, up to the tokenizer's eos (ScriptedBackend cuts at the request's own stops)."""
        text = self.turn_text(self.tokenizer.decode(prompt, skip_special_tokens=False))
        ids = list(self.tokenizer.encode(text, add_special_tokens=False))
        eos = self.tokenizer.eos_token_id
        return ids[: ids.index(eos) + 1] if eos in ids else ids


# -- scripted servers in subprocesses ---------------------------------------------------------------


@contextlib.contextmanager
def scripted_servers(
    count: int = 2, latency_s: float = 0.0, timeout_s: float = 60.0, mode: str | Sequence[str] = "--scripted"
) -> Iterator[list[str]]:
    """`count` SGLang-protocol dev servers in scripted mode (`python -m backends.devserver --scripted`, or
    `mode`, e.g. `--scripted-calculator`; given a list of modes, server i runs the i-th), as subprocesses on free
    loopback ports, started together; yields their URLs once each answers /health, stops them on exit. Unlike
    `DevServer`, which serves from the caller's event loop, these keep serving while the caller blocks (a
    synchronous `generate_sequences`, a `ray.get`) and do not compete for the caller's GIL."""
    procs, urls = [], []
    try:
        modes = [mode] * count if isinstance(mode, str) else list(mode)
        for k in range(count):
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            flags = f"--port {port} --latency {latency_s} --log-level warning".split()
            cmd = [sys.executable, "-m", "backends.devserver", modes[k % len(modes)], *flags]
            procs.append(subprocess.Popen(cmd, stdin=subprocess.DEVNULL))
            urls.append(f"http://127.0.0.1:{port}")
        deadline = time.monotonic() + timeout_s
        for proc, url in zip(procs, urls):
            while True:
                try:
                    with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                        if r.status == 200:
                            break
                except OSError:
                    pass
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"dev server {url} did not come up (exit code {proc.poll()})")
                time.sleep(0.05)
        yield urls
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
