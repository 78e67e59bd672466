"""YAML -> AgentSpec with every problem reported as `path:line:col: code: message`.

Positions come from ruamel.yaml's round-trip loader. `extends:` merges a child over its base (mappings key
by key, lists and scalars replace); a merged key keeps the position of the file that defined it, so an
inherited problem points into the base file and says which spec reached it.

`agentfsm validate` reads specs in editors and CI before anyone trusts them, so reading is bounded and every
failure is a positioned problem, never a traceback. Bytes: `MAX_BYTES + 1` at most for a spec and its bases
together, of regular files only (`/dev/zero` or a pipe never ends). Nodes: aliases expanded, so a "billion
laughs" fails at the alias that crosses `MAX_NODES`. Depth: `MAX_DEPTH`, aliases expanded, which also keeps
the recursive walks after parsing (ruamel's composer, the position recorder, pydantic) far from the recursion
limit. Tags: a spec is data, so every tag beyond YAML's core scalars and collections is refused where it
stands. The counting happens in the parser's event stream as ruamel's composer pulls it, so the limits stop
the parse itself; the scanner bounds `[` and `{` nesting itself (its look-ahead per open bracket makes deep
unclosed nesting slow before the parser sees it).
"""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import UnionType
from typing import Any, Union, get_args, get_origin

from pydantic import BaseModel, ValidationError
from ruamel.yaml import YAML
from ruamel.yaml.comments import CommentedMap, CommentedSeq
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

from fsm.spec.model import SPECS_DIR, AgentSpec

# ruamel's round-trip parser is slow per node: these bounds keep the worst case well under a second and a
# few MB (tests/test_faults.py measures it), with room for specs dozens of times larger than any shipped one.
MAX_BYTES = 128 * 1024  # a spec and its bases together
MAX_NODES = 5_000  # mappings, sequences and scalars of a spec and its bases, aliases expanded
MAX_DEPTH = 64  # nesting of mappings and sequences (guards and tool schemas need ~20)
MAX_EXTENDS = 16  # files in one `extends:` chain (all within one Budget)
TOO_DEEP = f"mappings and sequences nest at most {MAX_DEPTH} deep in a spec"
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
    """Point at the construct that opened the problem when the parser tells it, else at the problem: an
    unclosed `{`, `[` or quote is only noticed where the parser gives up, often the end of the file, but the
    fix goes where it opened (the flow collection still open, if on an earlier line; ruamel's context mark).
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
                raise _at(ev, "too-deep", TOO_DEEP)
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
            raise _at(ev, "too-deep", TOO_DEEP + why)
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
            raise YamlProblem("too-deep", TOO_DEEP, mark.line + 1, mark.column + 1)
        super().fetch_flow_collection_start(TokenClass, to_push)


@dataclass(frozen=True)
class Diagnostic:
    path: str
    line: int
    col: int
    code: str
    message: str
    severity: str = "error"  # "warning": reported by `validate`, never refused

    def __str__(self) -> str:
        level = "warning: " if self.severity == "warning" else ""
        return f"{self.path}:{self.line}:{self.col}: {level}{self.code}: {self.message}"


class SpecError(Exception):
    """A spec that does not validate. `diagnostics` holds every problem found, in file order.

    `salvaged` is the spec with its ill-typed and unknown keys dropped, when that much validates: the
    semantic checks run on it too, so one typo does not hide the rest of the problems.
    """

    def __init__(self, diagnostics: list[Diagnostic], salvaged: LoadedSpec | None = None):
        self.diagnostics = sorted(diagnostics, key=lambda d: (d.path, d.line, d.col))
        self.salvaged = salvaged
        super().__init__("\n".join(str(d) for d in self.diagnostics))


Pos = tuple[str, int, int]  # (file, 1-based line, 1-based col)


class Positions:
    """Where each mapping key and sequence item of a loaded document came from."""

    def __init__(self) -> None:
        self._key: dict[tuple[int, Any], Pos] = {}
        self._value: dict[tuple[int, Any], Pos] = {}
        self._node: dict[int, Pos] = {}
        self._keep: list[Any] = []  # keeps nodes alive so their ids stay unique

    def record(self, node: Any, path: str) -> None:
        self._keep.append(node)
        if not isinstance(node, (CommentedMap, CommentedSeq)):
            return
        # an empty document's map has no position: 1:1. Keys merged in by `<<: *anchor` have no position of
        # their own: they take the mapping's.
        here = self._node[id(node)] = (path, (node.lc.line or 0) + 1, (node.lc.col or 0) + 1)
        marks = node.lc.data  # key or index -> [line, col(, value line, value col)], 0-based
        items = node.items() if isinstance(node, CommentedMap) else enumerate(node)
        for key, value in items:
            lc = marks.get(key) if isinstance(marks, dict) else None
            if lc is None or len(lc) < 2:
                self._key[(id(node), key)] = self._value[(id(node), key)] = here
            else:
                self._key[(id(node), key)] = (path, lc[0] + 1, lc[1] + 1)
                vl, vc = lc[2:4] if len(lc) >= 4 else lc[:2]
                self._value[(id(node), key)] = (path, vl + 1, vc + 1)
            self.record(value, path)

    def copy_key(self, src: Any, dst: Any, key: Any) -> None:
        for table in (self._key, self._value):
            if (id(src), key) in table:
                table[(id(dst), key)] = table[(id(src), key)]

    def locate(self, root: Any, loc: tuple[Any, ...], *, key: bool = True) -> Pos:
        """Position of the deepest node of `loc` present in the document (unknown loc parts are skipped)."""
        node, best = root, self._node.get(id(root), ("?", 1, 1))
        for i, part in enumerate(loc):
            last = i == len(loc) - 1
            if isinstance(node, dict) and part in node:
                table = self._key if (key or not last) else self._value
                best = table.get((id(node), part), self._node.get(id(node[part]), best))
                node = node[part]
            elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
                best = self._key.get((id(node), part), best)
                node = node[part]
        return best


def _read(path: Path, positions: Positions, diags: list[Diagnostic], budget: Budget) -> Any:
    """One file, bounded and plain data only (see the module's docstring), with its positions recorded."""
    try:
        doc = load(read_text(path, budget), budget)
    except YamlProblem as p:
        diags.append(Diagnostic(str(path), p.line, p.col, p.code, p.message))
        return None
    if doc is None:
        doc = CommentedMap()
    if not isinstance(doc, CommentedMap):
        diags.append(Diagnostic(str(path), 1, 1, "type", "a spec must be a YAML mapping"))
        return None
    positions.record(doc, str(path))
    return doc


def _merge(base: Any, child: Any, positions: Positions) -> Any:
    """Child over base: mappings merge recursively, everything else is replaced by the child."""
    if not (isinstance(base, dict) and isinstance(child, dict)):
        return child
    for key, value in base.items():
        if key not in child:
            child[key] = value
            positions.copy_key(base, child, key)
        elif isinstance(value, dict) and isinstance(child[key], dict):
            child[key] = _merge(value, child[key], positions)
    return child


def load_document(
    path: str | Path,
    positions: Positions,
    diags: list[Diagnostic],
    _seen: tuple = (),
    _budget: Budget | None = None,
) -> Any:
    """Read one spec file with its `extends:` chain merged in."""
    path = Path(path)
    budget = _budget or Budget()
    doc = _read(path, positions, diags, budget)
    if doc is None:
        return None
    parent = doc.get("extends")
    if parent is None:
        return doc
    file, line, col = positions.locate(doc, ("extends",), key=False)
    if not isinstance(parent, str):
        diags.append(Diagnostic(file, line, col, "type", "extends: expects a file path"))
        return doc
    searched = _bases(path, parent)
    base_path = next((p for p in searched if p.exists()), searched[0])
    if base_path.resolve() in _seen or base_path.resolve() == path.resolve():
        problem = f"extends cycle through {parent!r}"
    elif not base_path.exists():
        where = ", ".join(str(p) for p in dict.fromkeys(searched))
        problem = (
            f"base spec {parent!r} not found (looked for {where}; "
            f"the shipped specs are named by file, e.g. extends: tool_agent.yaml)"
        )
    elif not base_path.is_file():
        problem = f"base spec {parent!r} is not a regular file"
    elif len(_seen) + 1 >= MAX_EXTENDS:
        problem = f"an extends chain may hold at most {MAX_EXTENDS} files"
    else:
        problem = None
    if problem is not None:
        diags.append(Diagnostic(file, line, col, "extends", problem))
        return doc
    base = load_document(base_path, positions, diags, (*_seen, path.resolve()), budget)
    if base is None:
        return doc
    base.pop("name", None) if "name" in doc else None
    return _merge(base, doc, positions)


def _bases(child: Path, parent: str) -> list[Path]:
    """Where `extends: parent` may be: beside the child (shown as relative as the child's path), then among the
    shipped specs, so a spec anywhere can extend `tool_agent.yaml` (or `tool_agent`)."""
    names = [parent] if parent.endswith((".yaml", ".yml")) else [parent, f"{parent}.yaml"]
    beside = [Path(os.path.normpath(child.parent / name)) for name in names]
    shipped = [SPECS_DIR / name for name in names if Path(name).name == name]  # a bare file name only
    return beside + shipped


def _plain(node: Any) -> Any:
    if isinstance(node, dict):
        return {
            str(k) if not isinstance(k, (str, int, float, bool)) else k: _plain(v) for k, v in node.items()
        }
    if isinstance(node, list):
        return [_plain(v) for v in node]
    return node


def _unwrap(tp: Any) -> Any:
    """Optional[X] -> X; leaves list/dict alone."""
    if get_origin(tp) is Union or get_origin(tp) is UnionType:
        args = [a for a in get_args(tp) if a is not type(None)]
        models = [a for a in args if isinstance(a, type) and issubclass(a, BaseModel)]
        return models[0] if models else args[0]
    return tp


def _model_at(loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The pydantic model class that owns the last part of `loc` (for "did you mean" suggestions)."""
    current: Any = AgentSpec
    for part in loc[:-1]:
        current = _unwrap(current)
        if isinstance(current, type) and issubclass(current, BaseModel):
            field = next((f for n, f in current.model_fields.items() if part in (n, f.alias)), None)
            if field is None:
                return None
            current = field.annotation
        elif get_origin(current) in (list, dict):
            current = get_args(current)[-1]  # the part is an index or a key
        else:
            return None
    current = _unwrap(current)
    return current if isinstance(current, type) and issubclass(current, BaseModel) else None


def _did_you_mean(loc: tuple[Any, ...]) -> str:
    model = _model_at(loc)
    if model is None:
        return ""
    names = [f.alias or n for n, f in model.model_fields.items()]
    close = difflib.get_close_matches(str(loc[-1]), names, n=1, cutoff=0.5)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return f"{hint} (allowed: {', '.join(sorted(names))})"


def _pydantic_diagnostics(err: ValidationError, doc: Any, positions: Positions) -> list[Diagnostic]:
    out = []
    for e in err.errors():
        loc = tuple(e["loc"])
        kind = e["type"]
        if kind == "extra_forbidden":
            file, line, col = positions.locate(doc, loc, key=True)
            out.append(
                Diagnostic(file, line, col, "unknown-key", f"unknown key {loc[-1]!r}{_did_you_mean(loc)}")
            )
        elif kind == "missing":
            file, line, col = positions.locate(doc, loc[:-1], key=True)
            where = ".".join(map(str, loc[:-1])) or "the spec"
            out.append(Diagnostic(file, line, col, "missing-key", f"{where} needs {loc[-1]!r}"))
        else:
            file, line, col = positions.locate(doc, loc, key=False)
            where = ".".join(str(p) for p in loc if not (isinstance(p, str) and "[" in p))
            out.append(
                Diagnostic(file, line, col, "type", f"{where}: {e['msg'].removeprefix('Value error, ')}")
            )
    return _dedupe(out)


def _dedupe(diags: list[Diagnostic]) -> list[Diagnostic]:
    seen, out = set(), []
    for d in diags:
        # One diagnostic per position and code (a union type fails once per member), except that each
        # missing key is its own problem even though they all point at the same parent.
        key = (d.path, d.line, d.col, d.code, d.message if d.code == "missing-key" else None)
        if key not in seen:
            seen.add(key)
            out.append(d)
    return out


@dataclass
class LoadedSpec:
    """A spec plus what is needed to point diagnostics at its source."""

    spec: AgentSpec
    path: Path
    doc: Any
    positions: Positions

    def where(self, *loc: Any, key: bool = True) -> Pos:
        return self.positions.locate(self.doc, loc, key=key)

    def diagnostic(self, code: str, message: str, *loc: Any, key: bool = True) -> Diagnostic:
        file, line, col = self.where(*loc, key=key)
        return reached_from(Diagnostic(file, line, col, code, message), self.path)


def reached_from(d: Diagnostic, root: str | Path) -> Diagnostic:
    """A diagnostic inside a base spec says which spec extended it, so the reader knows why it shows."""
    if d.path == str(root) or d.message.endswith(f"(reached from {root})"):
        return d
    return replace(d, message=f"{d.message} (reached from {root})")


def load_spec(path: str | Path) -> LoadedSpec:
    """Parse and type-check a spec file (semantic checks live in fsm.validate). Raises SpecError."""
    positions = Positions()
    diags: list[Diagnostic] = []
    doc = load_document(path, positions, diags)
    if doc is None or diags:
        raise SpecError([reached_from(d, Path(path)) for d in diags])
    plain = _plain(doc)
    try:
        spec = AgentSpec.model_validate(plain)
    except ValidationError as err:
        salvaged = _salvage(plain, err)
        loaded = LoadedSpec(salvaged, Path(path), doc, positions) if salvaged else None
        diags = [reached_from(d, Path(path)) for d in _pydantic_diagnostics(err, doc, positions)]
        raise SpecError(diags, loaded) from None
    return LoadedSpec(spec, Path(path), doc, positions)


def _salvage(plain: dict[str, Any], err: ValidationError, rounds: int = 3) -> AgentSpec | None:
    """The spec without the keys pydantic rejected (defaults take their place), if that validates."""
    for _ in range(rounds):
        for e in err.errors():
            if e["type"] == "missing":
                return None  # nothing to drop: a required key has no default
            _drop(plain, tuple(e["loc"]))
        try:
            return AgentSpec.model_validate(plain)
        except ValidationError as again:
            err = again
    return None


def _drop(node: Any, loc: tuple[Any, ...]) -> None:
    """Delete the deepest existing key of `loc` (parts pydantic adds for union members are skipped)."""
    parent: dict | list | None = None
    key: Any = None
    for part in loc:
        if isinstance(node, dict) and part in node:
            parent, key, node = node, part, node[part]
        elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            parent, key, node = node, part, node[part]
    if isinstance(parent, dict):
        del parent[key]
    elif isinstance(parent, list):
        parent[key] = None
