"""`agentfsm gateway SPEC` and its Python form: a harness spec's rows run as `agentfsm run` runs them (one run
owner: the same outputs, snapshots, signals and tracing), with the gateway its harnesses call bound where the
flags say and bounded as they say. With `--workers N`, the rows run in N worker processes behind one front
listening there, and their outputs are merged into the one run directory (fsm/gateway/workers.py).

From Python, next to RolloutEngine:

    engine = RolloutEngine("examples/gateway/agents_sdk.yaml")
    gateway = serve(engine, host="127.0.0.1", port=8765)   # optional: a run starts a loopback one itself
    batch = engine.generate_sequences(rows)
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
from dataclasses import fields
from typing import Any

from fsm.gateway.server import Gateway, GatewayLimits
from fsm.run.engine import LocalEngine

log = logging.getLogger("agentfsm.gateway")


def serve(
    engine: LocalEngine, host: str = "127.0.0.1", port: int = 0, limits: GatewayLimits | None = None
) -> Gateway:
    """The gateway the harness states of `engine`'s runs use (started on the engine's loop at the first one,
    closed with the engine)."""
    _warn_if_public(host)
    return Gateway(host, port, limits).attach(engine.owned)


def _warn_if_public(host: str) -> None:
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if not loopback:
        log.warning(
            "the gateway listens on %s: any host that reaches it and knows a session's key can use the "
            "model through that session",
            host,
        )


def cmd_gateway(args: argparse.Namespace, run: Any, rollout: Any = None) -> int:
    """`agentfsm gateway SPEC`: `run` (the CLI's cmd_run) with the gateway configured first; with --workers N,
    `run` over worker processes (each a `run` of its rows with `rollout`, the CLI's own) behind a front."""
    config = None
    if args.worker_config is not None:  # a worker process: its parent's flags first
        from fsm.gateway.worker import worker_config

        config = worker_config(args)
    # the limits with a flag of their name (fsm/cli/gateway_args.py); the others keep their defaults
    limits = GatewayLimits(
        **{f.name: getattr(args, f.name) for f in fields(GatewayLimits) if hasattr(args, f.name)}
    )
    if config is not None:
        from fsm.gateway.worker import worker

        return worker(args, config, run, rollout, limits)
    _warn_if_public(args.host)
    if args.gateway_workers > 1:
        from fsm.gateway.workers import over_workers

        return run(args, rollout=over_workers(limits))
    args.gateway = Gateway(args.host, args.gateway_port, limits)  # the run's engine owns it (cmd_run)
    return run(args)
