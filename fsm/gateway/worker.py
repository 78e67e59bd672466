"""A worker process of `agentfsm gateway --workers N` (fsm/gateway/workers.py starts them and merges what they
roll out): it dies with its parent, beats its heartbeat, reads the run's token from a pipe, registers its own
loopback port with the front before anything else, runs its slice of the rows with a tagged gateway, and writes
what it rolled out for the parent (OUT/workers/wK/result.json)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fsm.gateway.reaper import PR_SET_PDEATHSIG, prctl
from fsm.gateway.server import Gateway, GatewayLimits
from fsm.gateway.workers import HEARTBEAT_S, REGISTER_TIMEOUT_S, RESULT, WorkerError
from fsm.output.keep import Rollout
from fsm.run.codec import encode_sampling, encode_trajectory


def worker_config(args: argparse.Namespace) -> dict[str, Any]:
    """A worker's config (its parent's flags put into `args`, its out dir OUT/workers/wK)."""
    path = Path(args.worker_config)
    config = json.loads(path.read_text())
    for key, value in config["args"].items():
        setattr(args, key, value)
    args.out = str(Path(config["args"]["out"]) / "workers" / config["tag"])
    # the parent prints and judges the run
    args.quiet, args.max_error_rate, args.gateway_workers = True, 1.0, 1
    return config


def worker(
    args: argparse.Namespace,
    config: dict[str, Any],
    run: Callable[..., int],
    rollout: Callable[..., Any],
    limits: GatewayLimits,
) -> int:
    """A worker process: register with the front, then `run` its rows (`rollout`, the CLI's own) with a tagged
    gateway on the registered port, and write what it rolled out for the parent."""
    tag, front, (start, end) = config["tag"], config["front"], config["rows"]
    _die_with_parent()
    if os.getppid() != config["parent"]:
        raise WorkerError(f"gateway worker {tag}: its parent (pid {config['parent']}) is gone")
    _heartbeat(config["heartbeat_fd"])
    sock = _register(front, tag, _read_token(config["token_fd"]))
    args.gateway = Gateway("127.0.0.1", 0, limits, tag=tag, front=front, sock=sock)  # its engine's (cmd_run)

    async def rows_of_mine(args: argparse.Namespace, rows: list[dict[str, Any]], console: Any) -> Rollout:
        if len(rows) != config["of"]:
            raise WorkerError(
                f"gateway worker {tag}: {len(rows)} rows here, {config['of']} in the parent (does the "
                "spec's demo_data give the same rows for the same seed?)"
            )
        done = await rollout(args, rows[start:end], console, first_index=start * args.n)
        _write_result(Path(args.out) / RESULT, done)
        return done

    return run(args, rollout=rows_of_mine)


def _register(front: str, tag: str, token: str) -> socket.socket:
    """Bind a loopback port for this worker's gateway and register it with the front: from here every session
    the worker opens is routed to it."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    body = json.dumps({"port": sock.getsockname()[1]}).encode()
    request = urllib.request.Request(
        f"{front}/workers/{tag}",
        data=body,
        method="POST",
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
    )
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never through a proxy
    try:
        opener.open(request, timeout=REGISTER_TIMEOUT_S).read()
    except urllib.error.HTTPError as exc:
        sock.close()
        raise WorkerError(
            f"gateway worker {tag}: the front at {front} refused it: {exc.code} {exc.read()[:200]!r}"
        ) from None
    except OSError as exc:
        sock.close()
        raise WorkerError(
            f"gateway worker {tag}: cannot register with the front at {front} ({exc})"
        ) from None
    return sock


def _write_result(path: Path, run: Rollout) -> None:
    """What the worker rolled out, for the parent: its trajectories as snapshots hold them (every slot)."""
    codec = run.engine.codec
    data = {
        "trajectories": [encode_trajectory(t) for t in run.trajs],
        "sampling": encode_sampling(run.sampling),
        "tokenizer": str(getattr(getattr(codec, "tokenizer", codec), "name_or_path", "")),
        "interrupted": run.interrupted,
        "wall_s": run.wall,
        "cpu_s": run.cpu,
        "ended": time.time(),
        "router": run.router_stats,
    }
    tmp = path.with_name(f".{path.name}.writing")
    tmp.write_text(json.dumps(data, default=str))
    os.replace(tmp, path)


def _read_token(fd: int) -> str:
    """The registration token from the parent's pipe, read to its end and closed, so no harness inherits it."""
    chunks = []
    with contextlib.suppress(OSError):
        while chunk := os.read(fd, 4096):
            chunks.append(chunk)
    with contextlib.suppress(OSError):
        os.close(fd)
    return b"".join(chunks).decode()


def _heartbeat(fd: int) -> None:
    """A byte on `fd` every HEARTBEAT_S from a thread of its own, for the parent's liveness check (`_silent`)."""
    os.set_inheritable(fd, False)  # never passed on to a harness

    def beat() -> None:
        while True:
            try:
                os.write(fd, b".")
            except OSError:  # the parent is gone
                return
            time.sleep(HEARTBEAT_S)

    threading.Thread(target=beat, name="agentfsm-heartbeat", daemon=True).start()


def _die_with_parent() -> None:
    """Linux: the kernel sends this process SIGTERM (handled as Ctrl-C) when its parent dies, however it dies."""
    if sys.platform == "linux":
        prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
