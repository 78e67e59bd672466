"""The servers `agentfsm run` drives: those --server names, plus SGLang or vLLM launched for the run
(--launch-sglang, --launch-vllm), all probed ready; and the tokenizer that goes with them. A launch or probe
that fails is one CLIError line (the log's last line, where a Python process says why it died); and a port
checked free before a server's model loads (`dev-server`)."""

from __future__ import annotations

import argparse
import sys
from contextlib import AsyncExitStack
from pathlib import Path

from fsm.cli.args import CLIError


def _launch_failure(message: str, engine: str = "sglang") -> str:
    """A LaunchError's message ("... log X ends with:\\n<tail>") as one line: the head and the log's last line,
    which is where a Python process says why it died."""
    head, _, tail = message.partition(" ends with:\n")
    lines = [line.strip() for line in tail.splitlines() if line.strip()]
    cause = lines[-1] if lines else "its log is empty"
    install = (
        "pip install sglang (on a GPU host)" if engine == "sglang" else "bash .ci/vllm_env.sh, --vllm-python"
    )
    hint = f"; {install}, or pass --server URL" if "No module named" in cause else ""
    return f"--launch-{engine}: {head.strip()}: {cause}{hint}"


async def servers_of(args: argparse.Namespace, stack: AsyncExitStack) -> tuple[list[str], str | None]:
    """The server URLs the flags name (launching SGLang first when asked), all ready; and the tokenizer
    path that goes with them."""
    servers = list(args.server or [])
    tokenizer = args.tokenizer
    for engine in ("sglang", "vllm"):
        model = getattr(args, f"launch_{engine}")
        if model:
            servers += await _launch(args, stack, engine, model)
            tokenizer = tokenizer or model
    if not servers:
        return servers, tokenizer
    from fsm.api import ServerNotReady, probe_servers

    try:
        probe = await probe_servers(
            servers, strict=args.strict_servers, engine=args.engine or ("vllm" if args.launch_vllm else None)
        )
    except ServerNotReady as exc:
        raise CLIError(
            f"no usable server: {exc}; start it (agentfsm dev-server, sglang or vllm) or fix --server"
            + ("" if args.strict_servers else " (every server failed)")
        ) from None
    for url, why in probe.left_out.items():
        print(
            f"warning: {url}: left out of this run: {why} (--strict-servers makes this an error)",
            file=sys.stderr,
        )
    servers, served = probe.servers, probe.tokenizer
    args.engine = probe.engine  # what they run, for the engine's clients
    if tokenizer is None:
        if not served or not Path(served).exists():
            raise CLIError(
                f"{servers[0]}: serves {served!r}, which is not a local directory; pass --tokenizer DIR"
            )
        tokenizer = served
    return servers, tokenizer


async def _launch(args: argparse.Namespace, stack: AsyncExitStack, engine: str, model: str) -> list[str]:
    """Launch `engine`'s servers for `model` (--launch-sglang, --launch-vllm) with the run's --dp, --tp, --port
    and --device, logs in OUT/ENGINE_logs, stopped with `stack`; their URLs, once ready."""
    from backends.launcher import LaunchError, SGLangLauncher, VLLMLauncher

    try:
        launcher = (SGLangLauncher if engine == "sglang" else VLLMLauncher)(
            model,
            dp=args.dp,
            tp=args.tp,
            base_port=args.port,
            log_dir=Path(args.out) / f"{engine}_logs",
            python=getattr(args, f"{engine}_python"),
            device="cpu" if args.device == "cpu" else None,
        )
        await stack.enter_async_context(launcher)
    except ValueError as exc:
        raise CLIError(f"--launch-{engine}: {exc}") from None
    except LaunchError as exc:
        raise CLIError(_launch_failure(str(exc), engine)) from None
    return launcher.urls


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
