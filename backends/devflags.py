"""The dev server's flags, declared once: `python -m backends.devserver` (backends/devserver.py) and
`agentfsm dev-server` (fsm/cli/bundled.py) both parse them with `dev_server_flags`, so the two accept the same
flags, defaults and checks. Only argparse here: the CLI builds its parser without loading the server."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

DTYPES = ["auto", "float32", "bfloat16", "float16"]  # the embedded model's (backends/hf.py)
LOG_LEVELS = ["debug", "info", "warning", "error"]


def _int(lo: int, hi: int | None = None) -> Callable[[str], int]:
    """An integer in [lo, hi], refused in fsm/cli/args.py `int_in`'s words."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < lo or (hi is not None and value > hi):
            bounds = f">= {lo}" if hi is None else f"from {lo} to {hi}"
            raise argparse.ArgumentTypeError(f"must be an integer {bounds}, got {value}")
        return value

    return parse


def _seconds(text: str) -> float:
    """A finite number of seconds, at least 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text}")
    return value


class Help(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The dev server's docstring as written, and "(default: X)" where fsm/cli/args.py `Help` shows one (not None,
    not a False switch): both `--help`s say the same of each flag."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


# the checks, one object each: both parsers hold the same ones
PORT, CONTEXT, COUNT = _int(1, 65535), _int(16), _int(1)
VOCAB = _int(11)  # HashLM draws its tokens from 10 up (backends/scripted.py)


def dev_server_flags(p: argparse.ArgumentParser) -> None:
    """The flags: which model it serves (the tiny one by default), where, and how."""
    add = p.add_argument
    add(
        "--model",
        "--model-path",
        dest="model",
        metavar="DIR",
        help="model dir (default: the tiny calculator model)",
    )
    add("--scripted", action="store_true", help="a deterministic echo model, no weights")
    add("--hashlm", action="store_true", help="HashLM, the deterministic autoregressive toy, no weights")
    add(
        "--scripted-tools",
        action="store_true",
        help="a scripted tool-calling model over --tokenizer, no weights: it writes a file with the harness's "
        "own write tool, then finishes (docs/gateway.md, 'Real size')",
    )
    add(
        "--scripted-calculator",
        action="store_true",
        help="the calculator's turns over --tokenizer, answered at once, no weights",
    )
    add(
        "--tokenizer",
        metavar="DIR",
        help="--scripted-tools, --scripted-calculator: its tokenizer (default: the tiny model's)",
    )
    add(
        "--script",
        metavar="FILE",
        help="--scripted-tools: a JSON list of steps (backends/scripted.py; default: write hello.txt, then finish)",
    )
    add("--vocab", type=VOCAB, default=1000, metavar="N", help="--hashlm: its vocabulary size")
    add("--stop-every", type=COUNT, default=8, metavar="N", help="--hashlm: mean tokens per turn")
    add(
        "--context-length",
        type=CONTEXT,
        metavar="N",
        help="the longest context served (default: the model's, or 4096)",
    )
    add(
        "--max-running-requests",
        type=COUNT,
        metavar="N",
        help="requests generated at once, the others wait (default: no bound)",
    )
    add(
        "--latency",
        type=_seconds,
        default=0.0,
        metavar="SECONDS",
        help="the models with no weights: seconds per request",
    )
    add("--host", default="127.0.0.1", help="address to listen on")
    add("--port", type=PORT, default=30000, help="port to listen on")
    add("--device", help="cpu, cuda, cuda:1 (default: cuda if available)")
    add("--dtype", choices=DTYPES, help="default: auto, see backends/hf.py")
    add("--log-level", choices=LOG_LEVELS, default="info", help="the server's log")
