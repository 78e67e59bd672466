"""`agentfsm gateway`'s own flags (fsm/gateway/serve.py runs the command): where the gateway listens, its
limits, and its worker processes; with the flags that cannot go with --workers N refused as usage errors."""

from __future__ import annotations

import argparse

from fsm.cli.args import COUNT, Parser, int_in, run_flags, seconds_flag


def gateway_only_flags(p: argparse.ArgumentParser) -> None:
    """`agentfsm gateway`'s own flags, after `run`'s (fsm/cli/args.py): where the gateway listens, what it
    accepts (fsm/gateway/server.py GatewayLimits), and its worker processes."""
    from fsm.gateway.server import GatewayLimits

    p.add_argument("--host", default="127.0.0.1", help="the gateway's address (default: loopback only)")
    p.add_argument(
        "--gateway-port",
        type=int_in(0, 65535),
        default=0,
        metavar="PORT",
        help="the gateway's port (default: any free one)",
    )
    for field, metavar, text in (
        ("max_sessions", "N", "sessions open at once; past it a row ends in error"),
        ("max_request_bytes", "BYTES", "the largest request body (413 past it)"),
        ("max_messages", "N", "messages in one request"),
        (
            "max_segments",
            "N",
            "segments per session (each history that differs from the recorded one starts one); past it a "
            "request gets 400 too_many_segments",
        ),
    ):  # GatewayLimits' bounds, each a flag of its name
        flag = "--" + field.replace("_", "-")
        p.add_argument(flag, type=COUNT, default=getattr(GatewayLimits, field), metavar=metavar, help=text)
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
    p.add_argument(  # the rows over N worker processes behind one front (fsm/gateway/workers.py)
        "--workers",
        dest="gateway_workers",
        type=COUNT,
        default=1,
        metavar="N",
        help="run the rows in N worker processes, each its own engine and gateway (max-sessions each; "
        "the embedded model: --threads default its share of the cores), behind one front at "
        "--host/--gateway-port; their outputs are merged into --out, each worker's own kept in "
        "OUT/workers/",
    )
    text = "with --workers: how long a worker may take to start and register with the front"
    seconds_flag(p, "--worker-start-timeout", 120.0, text)
    text = (
        "with --workers: how long a registered worker may go without its heartbeat (one a second, from a "
        "thread of its own) before it is taken for dead (stopped or frozen)"
    )
    seconds_flag(p, "--worker-silent-timeout", 30.0, text)
    # a worker process's own: what its parent gave it
    p.add_argument("--worker-config", help=argparse.SUPPRESS)
    if isinstance(p, Parser):
        p.checks.append(_check_workers)


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


def gateway_flags(p: argparse.ArgumentParser) -> None:
    """`agentfsm gateway SPEC`: `run`'s flags, then where the gateway listens (fsm/gateway/serve.py)."""
    run_flags(p, workers=False)
    gateway_only_flags(p)
