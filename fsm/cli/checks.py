"""What `agentfsm` checks before a command's work starts, so a mistake costs a line, not a wait: that a run
drawn by `render --run` is of the spec drawn, and that `dev-server`'s port is free before its model loads."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fsm.cli.outcome import CLIError
from fsm.run.signals import warn


def same_spec(run: str, spec_path: str, agent: Any) -> None:
    """A run drawn over another spec's diagram would put its counts on edges it never took: refused; over its
    own spec edited since, a warning (the counts are the run's, the edges today's)."""
    path = Path(run) / "summary.json" if Path(run).is_dir() else Path(run)
    try:
        summary = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return  # load_run_stats says what is wrong with it
    if not isinstance(summary, dict) or summary.get("spec_hash") in (None, agent.hash):
        return
    ran, spec = str(summary["spec_hash"]), summary.get("spec")
    if spec and Path(spec).resolve() != Path(spec_path).resolve():
        raise CLIError(
            f"--run {run}: that run is of another spec ({spec}), not {spec_path}; render the run "
            "with its own spec"
        )
    warn(
        f"--run {run}: {spec_path} changed since that run (spec hash {ran[:12]}, now {agent.hash[:12]}); "
        "its counts are drawn on today's edges"
    )


def port_free(host: str, port: int) -> None:
    """Bind host:port as the server will (SO_REUSEADDR, as aiohttp does), then let it go."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise CLIError(f"--host {host}: cannot serve there ({exc.strerror or exc})") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as exc:
            raise CLIError(
                f"--port {port}: cannot serve on {host}:{port} ({exc.strerror or exc}); stop what "
                "holds it or pick another --port"
            ) from None
