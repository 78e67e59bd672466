"""The building blocks of `agentfsm`'s command line (fsm/cli/args.py): range-checked number types, URL
types, usage errors as one line, and help that shows defaults. Every numeric flag takes one of these types, so
a value out of range (`--concurrency 0`, `--num-prompts -1`, `--trace-sample 2`, `--temperature nan`) is
refused before anything runs."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import Any, NoReturn


def int_in(lo: int, hi: int | None = None) -> Callable[[str], int]:
    """An argparse type: an integer in [lo, hi]."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < lo or (hi is not None and value > hi):
            raise argparse.ArgumentTypeError(f"must be an integer {_bounds(lo, hi)}, got {value}")
        return value

    return parse


def float_in(lo: float, hi: float | None = None, *, above: bool = False) -> Callable[[str], float]:
    """An argparse type: a finite number >= lo (> lo with `above`), <= hi."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if (
            not math.isfinite(value)
            or value < lo
            or (above and value == lo)
            or (hi is not None and value > hi)
        ):
            bound = f"> {lo:g}" if above else _bounds(lo, hi)
            raise argparse.ArgumentTypeError(f"must be a number {bound}, got {text}")
        return value

    return parse


def server_url(text: str) -> str:
    """An argparse type: an http(s) URL; `localhost:30000` gets the line that fixes it."""
    scheme, sep, rest = text.partition("://")
    if not sep:
        raise argparse.ArgumentTypeError(f"{text!r} is not a URL; did you mean http://{text}?")
    if scheme not in ("http", "https") or not rest.strip("/"):
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected an http:// or https:// URL such as http://localhost:30000"
        )
    return text


def otlp_endpoint(text: str) -> str:
    """An argparse type: --otlp's endpoint, checked when the flags are read (not after the model loads);
    `localhost:4318` is http://localhost:4318, as the SDK reads OTEL_EXPORTER_OTLP_ENDPOINT."""
    from fsm.telemetry.export import otlp_url

    try:
        return otlp_url(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _bounds(lo: float, hi: float | None) -> str:
    return f">= {lo:g}" if hi is None else f"from {lo:g} to {hi:g}"


COUNT = int_in(1)  # how many of something: at least one
PORT = int_in(1, 65535)


def seconds_flag(p: Any, flag: str, default: float | None, text: str) -> None:
    """A flag of a duration: seconds, more than 0."""
    p.add_argument(flag, type=float_in(0.0, above=True), default=default, metavar="SECONDS", help=text)


class Parser(argparse.ArgumentParser):
    """Usage errors as one line (argparse prints the whole usage first). `checks`: what no single flag can
    check alone (flags that cannot go together), each a function of the parsed flags that returns the problem
    or None, reported as any usage error."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.checks: list[Callable[[argparse.Namespace], str | None]] = []

    def parse_known_args(  # type: ignore[override]  # one signature for argparse's overloads
        self, args: Any = None, namespace: Any = None
    ) -> tuple[argparse.Namespace, list[str]]:
        parsed, extras = super().parse_known_args(args, namespace)
        for check in self.checks:
            if problem := check(parsed):
                self.error(problem)
        return parsed, extras

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class Help(argparse.ArgumentDefaultsHelpFormatter):
    """Shows "(default: X)" where there is a default worth showing (not None, not a False switch)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)
