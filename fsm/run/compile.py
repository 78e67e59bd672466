"""AgentSpec -> CompiledAgent (fsm/run/agent.py): every name resolved, every check done.

Compilation is validation: unknown states, guards, actions, tools, parsers, import paths, missing default
edges, unreachable states, dead ends and contradictory limits are all reported here, with positions, so a
running batch never meets an unknown name. `static=True` (`agentfsm validate --static`, what editors and CI
run on specs nobody has vetted) does every check that needs no import: schema, graph, built-in names,
and import paths checked for form and against the deny-list of fsm.spec.registry; nothing the spec names runs.

A `tools:` entry becomes a BoundTool here (`build_tool`): its function or class resolved, its schema declared or
inferred (`infer_schema`), and the lane its code runs in (fsm/tools/isolation.py) chosen from `isolation:`.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

from fsm.families import family_names
from fsm.families.parsers import PARSERS
from fsm.run.actions import BUILTIN_ACTIONS
from fsm.run.agent import REWARD_EXTRAS, CompiledAgent, Edge, Reward
from fsm.run.interaction import REQUIRED_METHODS
from fsm.run.rewrites import make_rewrite
from fsm.run.tree import check_tree, child_schema, tree_size
from fsm.spec.failures import check_failures
from fsm.spec.loader import Diagnostic, LoadedSpec, SpecError, load_spec
from fsm.spec.model import DEFAULT_TOOL_WORKERS, AgentSpec, ToolSpec
from fsm.spec.registry import (
    ACTIONS,
    GUARDS,
    GuardError,
    ImportPathError,
    add_spec_folder,
    check_import_path,
    check_module,
    compile_guard,
    import_module,
    is_import_path,
    resolve,
)
from fsm.tools.base import BoundTool, FunctionTool, ToolSet, tool_retry
from fsm.tools.isolation import InlineLane, Lane, LoopLane, ThreadLane
from fsm.tools.processes import ProcessLane

BUDGET_ACTIONS = ("generate", "call_tools", "interact")  # built-ins that append tokens to the response

# --- compilation ------------------------------------------------------------------------------------------


def compile_spec(spec_or_path: AgentSpec | LoadedSpec | str | Path) -> CompiledAgent:
    """Load (if given a path), validate and compile. Raises SpecError listing every problem."""
    agent = _compile(spec_or_path, static=False)
    assert agent is not None
    return agent


def _compile(
    spec_or_path: AgentSpec | LoadedSpec | str | Path, static: bool, warnings: list[Diagnostic] | None = None
) -> CompiledAgent | None:
    loaded = spec_or_path if isinstance(spec_or_path, LoadedSpec) else None
    if isinstance(spec_or_path, (str, Path)):
        loaded = load_spec(spec_or_path)
    spec = loaded.spec if loaded else cast(AgentSpec, spec_or_path)
    compiler = _Compiler(spec, loaded, static)
    agent = compiler.compile()
    if warnings is not None:
        warnings += compiler.warnings
    return agent


class _Unchecked:
    """What a static check gets for an import path it may not import: any call is a bug."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a statically checked spec cannot run")


UNCHECKED = _Unchecked()


class _Compiler:
    def __init__(self, spec: AgentSpec, loaded: LoadedSpec | None, static: bool = False):
        self.spec, self.loaded, self.static = spec, loaded, static
        self.allow = tuple(spec.trust.allow_modules)
        self.folder = loaded.path.resolve().parent if loaded is not None else None
        if self.folder is not None and not static:  # its modules are importable
            add_spec_folder(self.folder)
        self.diags: list[Diagnostic] = []
        self.warnings: list[Diagnostic] = []  # what `validate` points out but a run accepts

    def resolve(self, ref: str) -> Any:
        """An import path -> its object, within the spec's trust opt-ins; UNCHECKED when static."""
        if self.static:
            check_import_path(ref, self.allow)
            return UNCHECKED
        return resolve(ref, self.allow, self.folder)

    def _ref(self, ref: str, *loc: Any) -> Any:
        """`resolve`, with a failure reported at `loc` (then None)."""
        try:
            return self.resolve(ref)
        except ImportPathError as exc:
            self.error(exc.code, str(exc), *loc, key=False)
            return None

    def error(self, code: str, message: str, *loc: Any, key: bool = True) -> None:
        self.diags.append(self._diagnostic(code, message, loc, key))

    def warn(self, code: str, message: str, *loc: Any, key: bool = True) -> None:
        self.warnings.append(replace(self._diagnostic(code, message, loc, key), severity="warning"))

    def _diagnostic(self, code: str, message: str, loc: tuple[Any, ...], key: bool) -> Diagnostic:
        if self.loaded:
            return self.loaded.diagnostic(code, message, *loc, key=key)
        return Diagnostic("<spec>", 0, 0, code, f"{'.'.join(map(str, loc))}: {message}")

    def compile(self) -> CompiledAgent | None:
        spec = self.spec
        for i, module in enumerate(spec.imports):
            try:
                check_module(module, self.allow) if self.static else import_module(
                    module, self.allow, self.folder
                )
            except ImportPathError as exc:
                self.error(exc.code, str(exc), "imports", i, key=False)
        self._check_limits()
        self._check_graph()
        self.diags += check_failures(
            self.spec, lambda code, message, *loc, key=True: self._diagnostic(code, message, loc, key)
        )
        edges = self._edges()
        actions = self._actions()
        tools = self._tools()
        built = None if self.static else set(tools.by_name)  # the names the model sees
        check_tree(spec, self.loaded.path if self.loaded else None, self.error, built)  # fsm/run/tree.py
        self._check_forks()
        size, tree = tree_size(spec), spec.tree
        if size is not None and size - 1 > tree.max_run_nodes:
            msg = (
                f"one tree can reach {size} nodes (tree: max_nodes {tree.max_nodes}, max_depth "
                f"{tree.max_depth}, max_children {tree.max_children}), more than tree.max_run_nodes "
                f"{tree.max_run_nodes} for the whole run: such a tree ends as an error row"
            )
            self.warn("tree-size", msg, "tree")
        for name, child in spec.children.items():
            schema = child.schema_
            if isinstance(schema, str):
                schema = self._ref(schema, "children", name, "schema")
            tools.schemas.append(child_schema(name, child, schema))
        interaction_cls = self._interaction()
        reward = self._reward()
        if spec.demo_data is not None:
            self._ref(spec.demo_data, "demo_data")
        family = spec.model.family
        if family not in family_names() and not (self.static and spec.imports):  # imports may add it
            msg = f"unknown model family {family!r}{_suggest(family, family_names())}"
            self.error("unknown-family", msg, "model", "family", key=False)
        if spec.parser is not None and spec.parser not in PARSERS:
            msg = f"unknown tool-call parser {spec.parser!r}{_suggest(spec.parser, PARSERS)}"
            self.error("unknown-parser", msg, "parser", key=False)
        if self.diags:
            raise SpecError(self.diags)
        if self.static:
            return None
        agent = CompiledAgent(spec, self.loaded, edges, actions, tools, interaction_cls, reward)
        agent.compile = compile_spec  # child machines compile their specs with it (fsm/run/tree.py)
        return agent

    def _check_limits(self) -> None:
        lim = self.spec.limits
        if lim.max_new_tokens is not None and lim.max_new_tokens > lim.response_length:
            msg = f"max_new_tokens ({lim.max_new_tokens}) exceeds response_length ({lim.response_length})"
            self.error("limits", f"{msg}: a single turn could never use it", "limits", "max_new_tokens")
        # tools answer with it
        if self.spec.tools and lim.max_tool_response_length >= lim.response_length * 8:
            msg = f"max_tool_response_length ({lim.max_tool_response_length} characters) cannot fit in "
            msg += f"response_length ({lim.response_length} tokens)"
            self.error("limits", msg, "limits", "max_tool_response_length")

    def _check_graph(self) -> None:
        spec, states = self.spec, self.spec.states
        if spec.initial not in states:
            msg = f"initial state {spec.initial!r} is not declared{_suggest(spec.initial, states)}"
            self.error("unknown-state", msg, "initial", key=False)
        if not spec.final_states:
            self.error("no-final", "no state is final: add e.g. `TERMINATED: {final: true}`", "states")
        for name, st in states.items():
            where = ("states", name)
            if st.final:
                if st.action:
                    self.error("final-action", f"final state {name} cannot have an action", *where, "action")
                if st.next:
                    self.error(
                        "final-edges", f"final state {name} cannot have outgoing edges", *where, "next"
                    )
                continue
            if not st.action:
                self.error("missing-key", f"state {name} needs an action (or `final: true`)", *where)
            if not st.next:
                self.error("no-default", f"state {name} has no outgoing edges", *where)
                continue
            for i, t in enumerate(st.next):
                if t.to not in states:
                    msg = f"edge to unknown state {t.to!r}{_suggest(t.to, states)}"
                    self.error("unknown-state", msg, *where, "next", i, "to", key=False)
            if st.next[-1].when is not None:
                msg = f"the last edge out of {name} is guarded: add an unguarded default edge last, so every "
                msg += "trajectory can leave the state"
                self.error("no-default", msg, *where, "next", len(st.next) - 1)
            for i, t in enumerate(st.next[:-1]):
                if t.when is None:
                    msg = f"edge {i} out of {name} has no guard, so edges after it never fire"
                    self.error("shadowed", msg, *where, "next", i)
        flow = {s: [t.to for t in st.next] + [c.to for c in st.catch] for s, st in states.items()}
        reachable = reach(spec.initial, flow)
        for name in states:
            if name not in reachable and spec.initial in states:
                self.error(
                    "unreachable", f"state {name} cannot be reached from {spec.initial}", "states", name
                )
        back = reversed_graph(flow)
        can_finish = set().union(*(reach(f, back) for f in spec.final_states))
        for name in states:
            if name in reachable and name not in can_finish and spec.final_states:
                self.error("dead-end", f"no path leads from {name} to a final state", "states", name)
        self._check_cycles({s: [t.to for t in st.next] for s, st in states.items()})
        for loop in rewrite_loops(states, spec.context.rewrites):
            msg = f"the cycle through {', '.join(loop)} rewrites the context with no model turn "
            msg += "(a `generate` state) in it: it could rewrite forever; route it through GENERATING"
            first = next(s for s in loop if states[s].action in spec.context.rewrites)
            self.error("rewrite-loop", msg, "states", first, "action")

    def _check_cycles(self, graph: dict[str, list[str]]) -> None:
        """Warn about a cycle none of whose states runs a built-in action that spends the response budget:
        unless its own actions do, only limits.max_transitions ends a trajectory caught in it."""
        states, done = self.spec.states, set()
        for name in states:
            loop = set() if name in done else cycle(name, graph)
            done |= loop
            if loop and not any(states[s].action in BUDGET_ACTIONS for s in loop if s in states):
                msg = f"the cycle through {', '.join(s for s in states if s in loop)} runs no action that "
                msg += (
                    f"spends the response budget ({', '.join(BUDGET_ACTIONS)}): unless its own actions do, a "
                )
                limit = self.spec.limits.max_transitions
                msg += f"trajectory caught in it ends only at limits.max_transitions ({limit})"
                self.warn("cycle-without-budget", msg, "states", name)

    def _check_forks(self) -> None:
        graph = {s: [t.to for t in st.next] for s, st in self.spec.states.items()}
        for name, st in self.spec.states.items():
            if st.fork is not None and st.final:
                self.error("fork", f"final state {name} cannot fork", "states", name, "fork")
            elif st.fork is not None and st.fork.times is None and cycle(name, graph):
                msg = f"state {name} forks on every entry and is on a cycle: the branches would multiply "
                msg += "each time round; give fork.times a bound"
                self.error("fork-in-loop", msg, "states", name, "fork", key=False)

    def _edges(self) -> list[Edge]:
        edges: list[Edge] = []
        for name, st in self.spec.states.items():
            for i, t in enumerate(st.next):
                guard, label = None, "default"
                if t.when is not None:
                    try:
                        guard, label = compile_guard(t.when, self.spec.limits, self.resolve)
                    except GuardError as exc:
                        msg = str(exc)
                        if exc.code == "unknown-guard" and exc.name is not None:
                            msg += _suggest(exc.name, GUARDS)
                        # Statically, an unknown name may be one the spec's imports (not run) register.
                        if not (exc.code == "unknown-guard" and self.static and self.spec.imports):
                            self.error(exc.code, msg, "states", name, "next", i, "when", key=False)
                edges.append(Edge(len(edges), name, t.to, guard, label, t.reason))
        for name, st in self.spec.states.items():  # after every guarded edge: their indices stay as they were
            for c in st.catch:
                label = f"catch {', '.join(c.errors)}"
                edges.append(Edge(len(edges), name, c.to, None, label, c.reason, tuple(c.errors)))
        return edges

    def _actions(self) -> dict[str, Any]:
        actions = {}
        for name, st in self.spec.states.items():
            ref = st.action
            if st.final or not ref:
                continue
            rewrite = self.spec.context.rewrites.get(ref)
            if rewrite is not None:
                fn = rewrite.function and self._ref(rewrite.function, "context", "rewrites", ref, "function")
                if not rewrite.function or fn is not None:
                    actions[name] = make_rewrite(ref, rewrite, fn or None)
            elif ref in BUILTIN_ACTIONS or ref in ACTIONS:
                actions[name] = BUILTIN_ACTIONS.get(ref) or ACTIONS[ref]
            elif is_import_path(ref):
                fn = self._ref(ref, "states", name, "action")
                if fn is None:
                    continue
                if fn is not UNCHECKED and not inspect.iscoroutinefunction(fn):
                    msg = f"action {ref!r} must be an async function (ctx, traj)"
                    self.error("type", msg, "states", name, "action", key=False)
                actions[name] = fn
            elif not (self.static and self.spec.imports):  # else the imports, not run here, may register it
                known = [*BUILTIN_ACTIONS, *ACTIONS, *self.spec.context.rewrites]
                msg = f"unknown action {ref!r}{_suggest(ref, known)}; built-in: {', '.join(BUILTIN_ACTIONS)}"
                self.error("unknown-action", msg, "states", name, "action", key=False)
        return actions

    def _tools(self) -> ToolSet:
        if self.static:
            self._tool_refs()
            return ToolSet([], self.spec.limits)
        bound: list[BoundTool] = []
        for i, tool_spec in enumerate(self.spec.tools):
            try:
                tool = build_tool(tool_spec, self.resolve)
            except ImportPathError as exc:
                field = "function" if tool_spec.function else "class"
                self.error(exc.code, str(exc), "tools", i, field, key=False)
                continue
            except Exception as exc:  # a tool constructor may raise anything; report it where it is declared
                self.error("tool", f"{type(exc).__name__}: {exc}", "tools", i)
                continue
            if any(t.name == tool.name for t in bound):
                self.error("duplicate", f"two tools are named {tool.name!r}", "tools", i)
            bound.append(tool)
        return ToolSet(bound, self.spec.limits, self.spec.tool_policy)

    def _tool_refs(self) -> None:
        """The static part of `_tools`: one of function/class, import paths by form, names unique."""
        names: set[str] = set()
        for i, t in enumerate(self.spec.tools):
            if bool(t.function) == bool(t.class_):
                self.error(
                    "tool", "ValueError: a tool needs exactly one of 'function' or 'class'", "tools", i
                )
            for field, ref in (("function", t.function), ("class", t.class_), ("schema", t.schema_)):
                if isinstance(ref, str):
                    self._ref(ref, "tools", i, field)
            if t.class_ and t.schema_ is None:
                msg = f"ValueError: tool class {t.class_!r} needs a 'schema' (OpenAI function schema)"
                self.error("tool", msg, "tools", i)
            name = t.name or (
                t.schema_.get("function", {}).get("name") if isinstance(t.schema_, dict) else None
            )
            if name in names:
                self.error("duplicate", f"two tools are named {name!r}", "tools", i)
            names.add(name) if name else None

    def _interaction(self) -> Any:
        spec = self.spec.interaction
        if spec is None:
            return None
        cls = self._ref(spec.class_, "interaction", "class")
        if cls is None or cls is UNCHECKED:
            return cls
        missing = [m for m in REQUIRED_METHODS if not callable(getattr(cls, m, None))]
        if missing:
            msg = f"interaction {spec.class_!r} lacks {', '.join(missing)}"
            self.error("type", msg, "interaction", "class", key=False)
        return cls

    def _reward(self) -> Reward | None:
        spec = self.spec.reward
        if spec is None:
            return None
        fn = self._ref(spec.function, "reward", "function")
        if fn is None:
            return None
        try:
            named: Mapping[str, inspect.Parameter] = inspect.signature(fn).parameters
        except (TypeError, ValueError):  # a builtin or an UNCHECKED placeholder: verl's arguments only
            named = {}
        lane: Lane | None = None  # a coroutine function: awaited on the run's loop
        if fn is not UNCHECKED and not inspect.iscoroutinefunction(fn):
            name = f"reward {spec.function}"
            lane = (
                InlineLane(name, threads=DEFAULT_TOOL_WORKERS, label=f"reward {spec.function!r}")
                if spec.isolation == "none"
                else ThreadLane(name, DEFAULT_TOOL_WORKERS)
            )
        extras = tuple(x for x in REWARD_EXTRAS if x in named and x not in spec.kwargs)
        return Reward(fn, dict(spec.kwargs), extras, lane)


def reach(start: str, graph: dict[str, list[str]]) -> set[str]:
    """`start` and every state its edges lead to."""
    seen, todo = {start}, [start]
    while todo:
        for nxt in graph.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def reversed_graph(graph: dict[str, list[str]]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {s: [] for s in graph}
    for s, nexts in graph.items():
        for t in nexts:
            out.setdefault(t, []).append(s)
    return out


def cycle(name: str, graph: dict[str, list[str]]) -> set[str]:
    """The states on a cycle through `name` with it (its strongly connected part); empty when it is on none."""
    loop = reach(name, graph) & reach(name, reversed_graph(graph))
    return loop if len(loop) > 1 or name in graph.get(name, ()) else set()


def rewrite_loops(states: dict[str, Any], rewrites: dict[str, Any]) -> list[list[str]]:
    """Cycles through a rewrite state with no model turn (`generate`) in them: each would rewrite forever."""
    graph = {
        s: [t.to for t in st.next if t.to in states and states[t.to].action != "generate"]
        for s, st in states.items()
        if st.action != "generate"
    }
    found, seen = [], set()
    for name, st in states.items():
        if st.action in rewrites and name not in seen and name in graph and (loop := cycle(name, graph)):
            seen |= loop
            found.append([s for s in states if s in loop])
    return found


def _suggest(word: str, choices: Any) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def validate_file(path: str | Path, *, static: bool = False) -> list[Diagnostic]:
    """Every problem of a spec file (empty when it is valid): type errors, then the semantic checks of
    what remains once the ill-typed keys are set aside. A valid spec may get warnings (`severity`).

    `static=True` imports nothing the spec names (see the module docstring); the default compiles it,
    which runs its `imports:` and the modules of its import paths."""
    warnings: list[Diagnostic] = []
    try:
        _compile(path, static, warnings)
    except SpecError as err:
        diags = list(err.diagnostics)
        if err.salvaged is not None:
            try:
                _compile(err.salvaged, static)
            except SpecError as more:
                seen = {(d.path, d.line, d.col, d.code) for d in diags}
                diags += [d for d in more.diagnostics if (d.path, d.line, d.col, d.code) not in seen]
        return sorted(diags, key=lambda d: (d.path, d.line, d.col))
    return warnings


# --- tools ------------------------------------------------------------------------------------------------


def infer_schema(fn: Callable[..., Any]) -> dict:
    """OpenAI function schema from type hints and a Google-style docstring (transformers' helper), without the
    `return` entry it makes of a `Returns:` section: templates render the schema as given, and a model trained
    on the OpenAI form (which has none) would meet a tool it never saw."""
    from transformers.utils import get_json_schema

    schema = get_json_schema(fn)
    schema["function"].pop("return", None)
    return schema


def _declared_schema(spec: ToolSpec, resolve_ref: Callable[[str], Any]) -> dict | None:
    """The spec's schema: inline, or the dict an import path names."""
    if isinstance(spec.schema_, str):
        schema = resolve_ref(spec.schema_)
        if not isinstance(schema, dict):
            kind = type(schema).__name__
            raise TypeError(f"schema {spec.schema_!r} is a {kind}, not an OpenAI function schema dict")
        return dict(schema)
    return dict(spec.schema_) if spec.schema_ is not None else None


def build_tool(spec: ToolSpec, resolve_ref: Callable[[str], Any] = resolve) -> BoundTool:
    """ToolSpec -> BoundTool, or ImportPathError / TypeError / ValueError with a readable message. `resolve_ref`
    turns import paths into objects (`_compile` passes one with the spec's trust opt-ins)."""
    if bool(spec.function) == bool(spec.class_):
        raise ValueError("a tool needs exactly one of 'function' or 'class'")
    declared = _declared_schema(spec, resolve_ref)
    if spec.function:
        fn = resolve_ref(spec.function)
        if not callable(fn):
            raise TypeError(f"{spec.function!r} is not callable")
        schema = declared or infer_schema(fn)
    else:
        assert spec.class_  # exactly one of the two (checked above)
        cls = resolve_ref(spec.class_)
        if declared is None:
            raise ValueError(f"tool class {spec.class_!r} needs a 'schema' (OpenAI function schema)")
        schema = declared
    name = spec.name or schema.get("function", {}).get("name")
    if not name:
        raise ValueError("the tool schema has no function name")
    if spec.name and schema.get("function", {}).get("name") != spec.name:
        schema = {**schema, "function": {**schema.get("function", {}), "name": spec.name}}
    if spec.function:
        if spec.isolation == "none" and not inspect.iscoroutinefunction(fn):
            why = "drop isolation: none to run it in its own threads"
            raise TypeError(
                "isolation: none runs coroutine functions only (they await on the run's event loop), "
                f"and {spec.function!r} is a sync function: {why}"
            )
        if spec.isolation == "process":
            lane: Lane = ProcessLane(name, spec.function, spec.workers)
        elif spec.isolation == "none":
            lane = InlineLane(name)
        elif inspect.iscoroutinefunction(fn):
            lane = LoopLane(name)
        else:
            lane = ThreadLane(name, spec.workers)
        tool: Any = FunctionTool(fn, schema, lane)
    else:
        tool = cls(dict(spec.config), schema)
        for method in ("create", "execute", "calc_reward", "release"):
            if not callable(getattr(tool, method, None)):
                raise TypeError(f"tool class {spec.class_!r} lacks the lifecycle method {method!r}")
            if spec.isolation == "none" and not inspect.iscoroutinefunction(getattr(tool, method)):
                why = "drop isolation: none to run it on the tool's own loop thread"
                raise TypeError(
                    f"isolation: none runs coroutines only, and {spec.class_!r}.{method} is not an async def: {why}"
                )
        lane = InlineLane(name) if spec.isolation == "none" else LoopLane(name)
    if hasattr(tool, "name"):
        tool.name = name
    retry = tool_retry(spec.retry.max_attempts, spec.retry.backoff_s)
    return BoundTool(name, tool, schema, spec.timeout_s, retry, lane)
