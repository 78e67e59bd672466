"""argparse pieces for `agentfsm`: range-checked number types, usage errors as one line, and help that shows
defaults. Every numeric flag takes one of these types, so a value out of range (`--concurrency 0`,
`--num-prompts -1`, `--trace-sample 2`, `--temperature nan`) is refused before anything runs."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import NoReturn


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
        if not math.isfinite(value) or value < lo or (above and value == lo) or (hi is not None and value > hi):
            bound = f"> {lo:g}" if above else _bounds(lo, hi)
            raise argparse.ArgumentTypeError(f"must be a number {bound}, got {text}")
        return value

    return parse


def _bounds(lo: float, hi: float | None) -> str:
    return f">= {lo:g}" if hi is None else f"from {lo:g} to {hi:g}"


COUNT = int_in(1)  # how many of something: at least one
PORT = int_in(1, 65535)


class Parser(argparse.ArgumentParser):
    """Usage errors as one line (argparse prints the whole usage first)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class Help(argparse.ArgumentDefaultsHelpFormatter):
    """Shows "(default: X)" where there is a default worth showing (not None, not a False switch)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)
