"""The checks `validate` runs on a spec's trees (docs/trees.md): policies named and used, child machines that
exist and cannot recurse without a bound, forks that cannot multiply without one. Each problem is reported at
its line through the compiler's `error(code, message, *loc)`."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from fsm.run.agent import child_spec_path
from fsm.spec.loader import SpecError, load_spec
from fsm.spec.model import AgentSpec

Report = Callable[..., None]
GENERATING_ACTIONS = ("generate",)


def child_schema(name: str, spec: Any, given: Any = None) -> dict[str, Any]:
    """The tool schema the parent's model sees for child machine `name`: `given` (the spec's `schema:`, renamed
    to the child's name), else one text argument."""
    if isinstance(given, dict):
        function = dict(given.get("function", given))
        function["name"] = name
        return {"type": "function", "function": function}
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": spec.description,
            "parameters": {
                "type": "object",
                "properties": {spec.input: {"type": "string", "description": "The task for the sub-agent."}},
                "required": [spec.input],
            },
        },
    }


def _load(path: Path) -> AgentSpec | None:
    try:
        return load_spec(path).spec
    except (SpecError, OSError):
        return None


def declared_tool_names(spec: AgentSpec) -> set[str]:
    """The names `spec`'s tools go by, as far as is known without importing them (`validate --static`): `name:`,
    an inline schema's, else for a schema inferred from the function its own name (`function: mod:calculator`)."""
    names = set()
    for t in spec.tools:
        inline = t.schema_.get("function", {}).get("name") if isinstance(t.schema_, dict) else None
        inferred = t.function.rpartition(":")[2] if t.function and t.schema_ is None else None
        name = t.name or inline or inferred
        if name:
            names.add(name)
    return names


def check_tree(spec: AgentSpec, path: Path | None, error: Report, tool_names: set[str] | None = None) -> None:
    """Every tree check of `spec` (loaded from `path`, None when built in memory); `tool_names`: its built tools'
    names (default: `declared_tool_names`, what a static check knows)."""
    declared = set(spec.policies) or {"default"}
    generating = [(n, st) for n, st in spec.states.items() if st.action in GENERATING_ACTIONS or st.policy]
    named: dict[str, str] = {}
    for name, st in spec.states.items():
        if st.policy is None:
            continue
        if st.policy not in declared:
            error(
                "unknown-policy",
                f"state {name} names policy {st.policy!r}, not under policies: "
                f"({', '.join(sorted(declared))})",
                "states",
                name,
                "policy",
                key=False,
            )
        named.setdefault(st.policy, name)
    if len(named) > 1:
        (a, sa), (b, sb) = list(named.items())[:2]
        error(
            "mixed-policy",
            f"states {sa} and {sb} generate with two policies ({a}, {b}); one machine's rows "
            "belong to one policy: start a child machine (children:) for the other",
            "states",
            sb,
            "policy",
            key=False,
        )
    used = ({spec.policy} if generating else set()) | set(named)
    if tool_names is None:
        tool_names = declared_tool_names(spec)
    for name, child in spec.children.items():
        if name in tool_names:
            error(
                "duplicate",
                f"child machine {name!r} has the name of a tool: the model would see two tools named {name!r} "
                "and a call could reach either; rename one (the tool's `name:` or the child's key)",
                "children",
                name,
            )
        if child.policy is not None:
            if child.policy not in declared:
                error(
                    "unknown-policy",
                    f"child machine {name} names policy {child.policy!r}, not under "
                    f"policies: ({', '.join(sorted(declared))})",
                    "children",
                    name,
                    "policy",
                    key=False,
                )
            used.add(child.policy)
        target = child_spec_path(child.spec, path)
        if target is None:
            used.add(spec.policy)
            continue
        loaded = _load(target) if target.is_file() else None
        if loaded is None:
            why = "no such file" if not target.is_file() else "it does not load (run validate on it)"
            error(
                "unknown-child",
                f"child machine {name}: spec {child.spec!r} ({target}): {why}",
                "children",
                name,
                "spec",
                key=False,
            )
        elif child.policy is None:
            used.add(loaded.policy)
    if spec.policies:
        for name in spec.policies:
            if name not in used:
                error(
                    "unused-policy",
                    f"policy {name} generates nowhere: no state or child machine uses it",
                    "policies",
                    name,
                )
    if spec.children and spec.tree.max_depth is None and _recursive(spec, path):
        error(
            "unbounded-recursion",
            "a child machine starts this spec again (directly or through others) and "
            "tree.max_depth is null: set a bound",
            "tree",
            "max_depth",
            key=False,
        )
    graph = {s: [t.to for t in st.next] for s, st in spec.states.items()}
    for name, st in spec.states.items():
        if st.fork is None:
            continue
        if st.final:
            error("fork", f"final state {name} cannot fork", "states", name, "fork")
        elif st.fork.times is None and _on_cycle(name, graph):
            error(
                "fork-in-loop",
                f"state {name} forks on every entry and is on a cycle: the branches would "
                "multiply each time round; give fork.times a bound",
                "states",
                name,
                "fork",
                key=False,
            )


def tree_size(spec: AgentSpec) -> int | None:
    """The most nodes one tree of `spec` can reach, the root included (None: no child machine and no fork, so a
    tree is its root): each node starts at most `max_children` nodes (a fork alone: its branches), down to
    `max_depth` (forks alone: also the forks a path may take, `times` summed), within `max_nodes`."""
    forks = [st.fork for st in spec.states.values() if st.fork is not None]
    if not spec.children and not forks:
        return None
    tree = spec.tree
    k, depth = tree.max_children, tree.max_depth
    if not spec.children:
        k = min(max(f.branches for f in forks), k)
        if all(f.times is not None for f in forks):
            times = sum(f.times or 0 for f in forks)
            depth = times if depth is None else min(depth, times)
    total, level = 1, 1
    for _ in range(depth if depth is not None else tree.max_nodes):
        level *= k
        total += level
        if total >= tree.max_nodes:
            return tree.max_nodes
    return total


def _on_cycle(start: str, graph: dict[str, list[str]]) -> bool:
    seen, todo = set(), list(graph.get(start, ()))
    while todo:
        s = todo.pop()
        if s == start:
            return True
        if s not in seen:
            seen.add(s)
            todo += graph.get(s, ())
    return False


def _recursive(spec: AgentSpec, path: Path | None) -> bool:
    """A chain of child machines leads from `spec` back to it."""
    me = path.resolve() if path is not None else None
    todo: list[tuple[AgentSpec, Path | None]] = [(spec, path)]
    seen: set[Path] = set()
    while todo:
        current, where = todo.pop()
        for child in current.children.values():
            target = child_spec_path(child.spec, where)
            if target is None or (me is not None and target == me):
                return True
            if target in seen or not target.is_file():
                continue
            seen.add(target)
            loaded = _load(target)
            if loaded is not None:
                todo.append((loaded, target))
    return False
