"""A server that answers a generate with a redirect (307, 308, 302) is a server fault: the client never follows it
(to another host or anywhere: a model server answers where it was asked, and a Location could point anywhere),
retries it as a 5xx and the router fails its sessions over to a healthy server. Before, the 307 came back as the
request's own error, "rejected rid ...: None", and rows a healthy second server could have served were lost
(issue 50). Real loopback servers and a real `agentfsm run`.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading

import pytest
from aiohttp import web

from backends.base import BackendUnavailable, GenerateRequest
from backends.devserver import DevServer
from backends.scripted import echo_backend
from backends.sglang import SGLangBackend
from tests.conftest import ASSETS, REPO, SPECS


class _Redirecting(DevServer):
    """A dev server whose /generate answers 307 to `target` (info and health answer as a dev server does)."""

    def __init__(self, target: str):
        super().__init__(echo_backend())
        self.target = target
        self.redirects = 0

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        self.redirects += 1
        return web.Response(status=307, headers={"Location": f"{self.target}/generate"})


class _Served:
    """A dev server on its own loop in a thread, so a CLI process can talk to it."""

    def __init__(self, server: DevServer):
        self.server = server
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        asyncio.run_coroutine_threadsafe(server.start(), self.loop).result(60)
        self.url = server.url

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.close(), self.loop).result(60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()
        self.loop.close()


def test_a_redirecting_server_fails_over_and_its_target_is_never_asked(tmp_path):
    healthy = _Served(DevServer(echo_backend()))
    bystander = _Served(DevServer(echo_backend()))  # where the redirect points: another host's server
    redirecting = _Served(_Redirecting(bystander.url))
    out = tmp_path / "out"
    try:
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "fsm.cli.commands",
                "run",
                str(SPECS / "calculator.yaml"),
                "--server",
                redirecting.url,
                "--server",
                healthy.url,
                "--tokenizer",
                str(ASSETS),
                "--num-prompts",
                "4",
                "--out",
                str(out),
                "-q",
            ],
            capture_output=True,
            text=True,
            cwd=REPO,
            timeout=600,
        )
        assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
        records = [json.loads(line) for line in (out / "trajectories.jsonl").read_text().splitlines()]
        assert len(records) == 4
        assert all(not r["termination_reason"].startswith("error") for r in records), records
        assert redirecting.server.redirects >= 1  # its sessions were sent there first, then moved
        assert len(healthy.server.log) >= 4 and len(bystander.server.log) == 0
    finally:
        for served in (redirecting, bystander, healthy):
            served.close()


async def test_a_redirect_alone_is_one_line_naming_where_it_pointed_and_no_control_call_takes_it_as_done():
    """With no second server the row's error says what happened (not "None"), and a control call answered 307
    (a weight update, a pause) is a failure, not a 3xx read as success."""
    bystander = DevServer(echo_backend())
    await bystander.start()
    redirecting = _Redirecting(bystander.url)
    await redirecting.start()
    client = SGLangBackend(redirecting.url, max_retries=1, backoff_s=0.01)
    try:
        with pytest.raises(BackendUnavailable) as caught:
            await client.generate(GenerateRequest("s1", [5, 6, 7], {"max_new_tokens": 4}, rid="s1_t00"))
        assert str(caught.value) == (
            f"{redirecting.url} unavailable after 2 attempt(s) of POST /generate (rid s1_t00): HTTP 307 for rid "
            f"s1_t00: redirected to '{bystander.url}/generate', which is not followed; a server fault"
        )
        assert redirecting.redirects == 2 and len(bystander.log) == 0
        with pytest.raises(BackendUnavailable, match="HTTP 307: redirected to"):
            await client._control("POST", "/generate", {"text": "hi"})
    finally:
        await client.close()
        await redirecting.close()
        await bystander.close()
