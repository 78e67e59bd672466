"""Reading a YAML file nobody has vetted yet: bounded in bytes, nodes and depth, and plain data only.

`agentfsm validate` reads specs in editors and CI before anyone has decided to trust them, so reading one
must cost little whatever it holds, and every way it can fail is a positioned problem, never a traceback:

- bytes: the file (and its `extends:` bases, which share one budget) is read `MAX_BYTES + 1` at a time at
  most, and only if it is a regular file (`/dev/zero` or a pipe would never end);
- nodes: every mapping, sequence and scalar counts, aliases expanded, so a 447-byte "billion laughs"
  fails at the alias that crosses `MAX_NODES` instead of growing every walk of the document after it;
- depth: mappings and sequences nest at most `MAX_DEPTH` deep (aliases expanded), which also keeps the
  recursive walks after parsing (ruamel's composer, the position recorder, pydantic) far from the
  recursion limit;
- tags: a spec is data, so `!!python/...`, `!foo` and every tag beyond YAML's core scalars and
  collections are refused where they stand.

The counting happens in the parser's event stream as ruamel's composer pulls it, so the limits stop the
parse itself and the document is parsed once. The scanner bounds `[` and `{` nesting itself: it reads
up to 1,024 characters ahead per open bracket, checking each token against every open one, so 100k
unclosed brackets cost it seconds before the parser sees the first.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ruamel.yaml import YAML
from ruamel.yaml.constructor import DuplicateKeyError
from ruamel.yaml.error import MarkedYAMLError, YAMLError
from ruamel.yaml.events import (
    AliasEvent,
    CollectionEndEvent,
    CollectionStartEvent,
    MappingStartEvent,
    ScalarEvent,
)
from ruamel.yaml.parser import RoundTripParser
from ruamel.yaml.reader import ReaderError
from ruamel.yaml.scanner import RoundTripScanner

# ruamel's round-trip parser is slow per node: these bounds keep the worst case well under a second and a
# few MB (tests/test_faults.py measures it), with room for specs dozens of times larger than any shipped one.
MAX_BYTES = 128 * 1024  # a spec and its bases together
MAX_NODES = 5_000  # mappings, sequences and scalars of a spec and its bases, aliases expanded
MAX_DEPTH = 64  # nesting of mappings and sequences (guards and tool schemas need ~20)
CORE_TAGS = frozenset(f"tag:yaml.org,2002:{t}" for t in ("str", "int", "float", "bool", "null", "map", "seq"))


class YamlProblem(Exception):
    """One problem reading the file, at a 1-based position."""

    def __init__(self, code: str, message: str, line: int = 1, col: int = 1):
        super().__init__(message)
        self.code, self.message, self.line, self.col = code, message, line, col


@dataclass
class Budget:
    """What is left to read; shared by a spec and its `extends:` chain."""

    bytes: int = MAX_BYTES
    nodes: int = MAX_NODES


def read_text(path: Path, budget: Budget) -> str:
    """The file's text, if it is a regular UTF-8 file within the byte budget."""
    try:
        if not path.is_file():
            what = (
                "a directory" if path.is_dir() else "a device, a pipe or a socket" if path.exists() else None
            )
            if what is None:
                path.stat()  # raises the OSError that says why (missing, no permission)
            raise YamlProblem("io", f"cannot read spec: {path} is {what}, not a regular file")
        with path.open("rb") as f:
            data = f.read(budget.bytes + 1)
    except OSError as exc:
        raise YamlProblem("io", f"cannot read spec: {exc.strerror or exc}") from None
    if len(data) > budget.bytes:
        too_large = (
            f"a spec (with its bases) may have at most {MAX_BYTES // 1024} KiB; this one goes on past here"
        )
        raise _at_byte(data, budget.bytes, "too-large", too_large)
    budget.bytes -= len(data)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        bad = f"not UTF-8: byte 0x{data[exc.start]:02x} cannot be decoded; save the spec as UTF-8"
        raise _at_byte(data, exc.start, "encoding", bad) from None


def _at_byte(data: bytes, offset: int, code: str, message: str) -> YamlProblem:
    """The problem placed at byte `offset` of the file (line and column in characters)."""
    start = data.rfind(b"\n", 0, offset) + 1
    line, col = data.count(b"\n", 0, offset) + 1, len(data[start:offset].decode("utf-8", "replace")) + 1
    return YamlProblem(code, message, line, col)


def load(text: str, budget: Budget) -> Any:
    """Parse one YAML document (round-trip, so positions survive). Raises YamlProblem."""
    yaml = YAML(typ="rt")
    yaml.allow_duplicate_keys = False
    yaml.Scanner, yaml.Parser = _BoundedScanner, _BoundedParser
    bounds = yaml.spec_bounds = _Bounds(budget)  # type: ignore[attr-defined]  # read by our scanner and parser
    try:
        return yaml.load(text)
    except YamlProblem:
        raise
    except DuplicateKeyError as exc:
        mark = exc.problem_mark
        key = str(exc.problem).split('"')[1] if '"' in str(exc.problem) else "?"
        raise YamlProblem("duplicate", f"duplicate key {key!r}", mark.line + 1, mark.column + 1) from None
    except MarkedYAMLError as exc:
        raise _syntax_problem(exc, bounds, text) from None
    except ReaderError as exc:  # a control character: the reader gives a character offset
        line = text.count("\n", 0, exc.position) + 1
        col = exc.position - (text.rfind("\n", 0, exc.position) + 1) + 1
        char = f"#x{exc.character:04x}" if isinstance(exc.character, int) else repr(exc.character)
        raise YamlProblem("yaml-syntax", f"unacceptable character {char}: {exc.reason}", line, col) from None
    except (YAMLError, RecursionError, ValueError) as exc:  # none expected past the checks above
        raise YamlProblem("yaml-syntax", f"{type(exc).__name__}: {exc}".splitlines()[0]) from None


def _syntax_problem(exc: MarkedYAMLError, bounds: _Bounds, text: str) -> YamlProblem:
    """Point at the construct that opened the problem when the parser tells it, else at the problem.

    An unclosed `{` or `[` is only noticed where the parser gives up, often the end of the file; the
    flow collection still open then, when it started on an earlier line, is where the fix goes. Likewise
    an unclosed quote: ruamel's context mark is its start.
    """
    problem, context = exc.problem_mark, exc.context_mark
    where = f"line {problem.line + 1}:{problem.column + 1}" if problem else "the end"
    opener = next((f.event for f in reversed(bounds.stack) if f.event.flow_style), None)
    if opener is not None and (problem is None or problem.line > opener.start_mark.line):
        bracket = "{" if isinstance(opener, MappingStartEvent) else "["
        mark = opener.start_mark
        message = f"this {bracket!r} is never closed (the parser stopped at {where}: {exc.problem})"
    elif context is not None and (
        problem is None or (problem.line != context.line and problem.index >= len(text.rstrip()))
    ):
        mark, message = context, f"{exc.context}, not closed before {where}: {exc.problem}"
    else:
        mark = problem or context
        message = str(exc.problem or exc.context)
        if exc.context and context is not None and problem is not None:
            message += f" ({exc.context} at line {context.line + 1})"
    line, col = (mark.line + 1, mark.column + 1) if mark is not None else (1, 1)
    return YamlProblem("yaml-syntax", message, line, col)


@dataclass
class _Frame:
    event: Any  # the CollectionStartEvent
    nodes_before: int  # nodes counted before this collection
    height: int = 1  # levels of collections from this one down (aliases expanded)


@dataclass
class _Bounds:
    """Counts nodes (aliases expanded) and depth as the events go by; raises YamlProblem at a limit."""

    budget: Budget
    counted: int = 0
    stack: list[_Frame] = field(default_factory=list)
    anchors: dict[str, tuple[int, int]] = field(default_factory=dict)  # anchor -> (nodes, height)

    def see(self, ev: Any) -> None:
        if (
            isinstance(ev, (ScalarEvent, CollectionStartEvent))
            and ev.tag is not None
            and ev.tag not in CORE_TAGS
        ):
            tag = ev.tag.replace("tag:yaml.org,2002:", "!!", 1)
            raise _at(
                ev,
                "yaml-tag",
                f"tag {tag!r} is not allowed: a spec is plain data, and a tag asks "
                "the loader to build an object; remove it",
            )
        if isinstance(ev, ScalarEvent):
            self._place(ev, 1, 0)
        elif isinstance(ev, AliasEvent):
            if any(f.event.anchor == ev.anchor for f in self.stack):
                raise _at(ev, "alias", f"alias *{ev.anchor} refers to a node that contains it")
            nodes, height = self.anchors.get(ev.anchor, (1, 0))  # an undefined alias: ruamel reports it
            self._place(ev, nodes, height, f" (alias *{ev.anchor} expands to {nodes} nodes)")
        elif isinstance(ev, CollectionStartEvent):
            if len(self.stack) >= MAX_DEPTH:
                raise _at(ev, "too-deep", f"mappings and sequences nest at most {MAX_DEPTH} deep in a spec")
            self._place(ev, 1, 0)
            self.stack.append(_Frame(ev, self.counted - 1))
        elif isinstance(ev, CollectionEndEvent) and self.stack:
            frame = self.stack.pop()
            if frame.event.anchor is not None:
                self.anchors[frame.event.anchor] = (self.counted - frame.nodes_before, frame.height)
            if self.stack:
                self.stack[-1].height = max(self.stack[-1].height, frame.height + 1)

    def _place(self, ev: Any, nodes: int, height: int, why: str = "") -> None:
        self.counted += nodes
        self.budget.nodes -= nodes
        if self.budget.nodes < 0:
            raise _at(
                ev,
                "too-large",
                f"a spec (with its bases) may have at most {MAX_NODES} mapping, "
                f"sequence and scalar nodes, aliases expanded{why}",
            )
        if len(self.stack) + height > MAX_DEPTH:
            raise _at(ev, "too-deep", f"mappings and sequences nest at most {MAX_DEPTH} deep in a spec{why}")
        if self.stack:
            self.stack[-1].height = max(self.stack[-1].height, height + 1)


def _at(ev: Any, code: str, message: str) -> YamlProblem:
    mark = ev.start_mark
    return YamlProblem(code, message, mark.line + 1, mark.column + 1)


class _BoundedParser(RoundTripParser):
    """ruamel's round-trip parser, with every event the composer takes counted against the bounds."""

    def get_event(self) -> Any:
        event = super().get_event()
        if event is not None:
            self.loader.spec_bounds.see(event)
        return event


class _BoundedScanner(RoundTripScanner):
    """ruamel's round-trip scanner, refusing `[` and `{` nested past MAX_DEPTH before it reads ahead."""

    def fetch_flow_collection_start(self, TokenClass: Any, to_push: str) -> None:
        if len(self.flow_context) >= MAX_DEPTH:
            mark = self.reader.get_mark()
            raise YamlProblem(
                "too-deep",
                f"mappings and sequences nest at most {MAX_DEPTH} deep in a spec",
                mark.line + 1,
                mark.column + 1,
            )
        super().fetch_flow_collection_start(TokenClass, to_push)
