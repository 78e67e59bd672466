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
from typing import Any

from fsm.gateway.server import Gateway, GatewayLimits

log = logging.getLogger("agentfsm.gateway")


def serve(
    engine: Any, host: str = "127.0.0.1", port: int = 0, limits: GatewayLimits | None = None
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


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return value


def _port(text: str) -> int:
    if not text.isdigit() or int(text) > 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port (0..65535; 0: any free one)")
    return int(text)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="the gateway's address (default: loopback only)")
    p.add_argument(
        "--gateway-port",
        type=_port,
        default=0,
        metavar="PORT",
        help="the gateway's port (default: any free one)",
    )
    p.add_argument(
        "--max-sessions",
        type=_positive,
        default=GatewayLimits.max_sessions,
        metavar="N",
        help="sessions open at once; past it a row ends in error",
    )
    p.add_argument(
        "--max-request-bytes",
        type=_positive,
        default=GatewayLimits.max_request_bytes,
        metavar="BYTES",
        help="the largest request body (413 past it)",
    )
    p.add_argument(
        "--max-messages",
        type=_positive,
        default=GatewayLimits.max_messages,
        metavar="N",
        help="messages in one request",
    )
    p.add_argument(
        "--max-segments",
        type=_positive,
        default=GatewayLimits.max_segments,
        metavar="N",
        help="segments per session (each history that differs from the recorded one starts one); "
        "past it a request gets 400 too_many_segments",
    )
    p.add_argument(
        "--unsupported-tools",
        choices=("drop", "refuse"),
        default=GatewayLimits.unsupported_tools,
        help="tools other than functions a harness sends (a hosted web_search, a namespace...): left out "
        "of the prompt and noted on the row (drop, the default), or answered 400 (refuse)",
    )
    p.add_argument(
        "--auxiliary-calls",
        choices=("keep", "separate", "drop"),
        default=GatewayLimits.auxiliary_calls,
        help="calls that are not the agent's own turns (a title, a compaction; docs/gateway.md): rows of their "
        "own, trained apart (separate: their policy is their kind, the default), kept as any, or dropped",
    )
    p.add_argument(
        "--workers",
        dest="gateway_workers",
        type=_positive,
        default=1,
        metavar="N",
        help="run the rows in N worker processes, each its own engine and gateway (max-sessions each; "
        "the embedded model: --threads default its share of the cores), behind one front at "
        "--host/--gateway-port; their outputs are merged into --out, each worker's own kept in "
        "OUT/workers/",
    )
    p.add_argument(
        "--worker-start-timeout",
        type=_seconds,
        default=120.0,
        metavar="SECONDS",
        help="with --workers: how long a worker may take to start and register with the front",
    )
    p.add_argument(
        "--worker-silent-timeout",
        type=_seconds,
        default=30.0,
        metavar="SECONDS",
        help="with --workers: how long a registered worker may go without its heartbeat (one a second, "
        "from a thread of its own) before it is taken for dead (stopped or frozen)",
    )
    p.add_argument(
        "--worker-config", help=argparse.SUPPRESS
    )  # a worker process's own: what its parent gave it
    checks = getattr(p, "checks", None)
    if checks is not None:
        checks.append(_check_workers)


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of seconds")
    return value


def _check_workers(args: argparse.Namespace) -> str | None:
    """The flags that cannot go with --workers N (N > 1)."""
    if args.gateway_workers == 1:
        return None
    if args.resume is not None:
        return (
            f"--resume cannot resume a run over --workers {args.gateway_workers}: each worker keeps its own "
            "snapshot in OUT/workers/; start the run again, or resume a single-process run without --workers"
        )
    if args.ray is not None:
        return (
            f"--ray with --workers {args.gateway_workers}: the worker processes are the gateway's; drop one"
        )
    if args.launch_sglang or args.launch_vllm:
        return (
            f"--launch-{'sglang' if args.launch_sglang else 'vllm'} with --workers {args.gateway_workers}: each "
            "worker would launch its own servers; launch them once and pass --server URL"
        )
    return None


def cmd_gateway(args: argparse.Namespace, run: Any, rollout: Any = None) -> int:
    """`agentfsm gateway SPEC`: `run` (the CLI's cmd_run) with the gateway configured first; with --workers N,
    `run` over worker processes (each a `run` of its rows with `rollout`, the CLI's own) behind a front."""
    config = None
    if args.worker_config is not None:  # a worker process: its parent's flags first
        from fsm.gateway.workers import worker_config

        config = worker_config(args)
    limits = GatewayLimits(
        max_request_bytes=args.max_request_bytes,
        max_messages=args.max_messages,
        max_sessions=args.max_sessions,
        max_segments=args.max_segments,
        unsupported_tools=args.unsupported_tools,
        auxiliary_calls=args.auxiliary_calls,
    )
    if config is not None:
        from fsm.gateway.workers import worker

        return worker(args, config, run, rollout, limits)
    _warn_if_public(args.host)
    if args.gateway_workers > 1:
        from fsm.gateway.workers import over_workers

        return run(args, rollout=over_workers(limits))
    args.gateway = Gateway(args.host, args.gateway_port, limits)  # the run's engine owns it (cmd_run)
    return run(args)
