"""Draw a spec as a state diagram (Graphviz or Mermaid), optionally annotated with a run's statistics.

    diagram(agent)                      -> graphviz.Digraph (left to right, in the order trajectories flow)
    diagram(agent, run_stats=stats)     -> the same with counts, shares, pen widths, times and end reasons
    to_mermaid(agent, run_stats=None)   -> a `stateDiagram-v2` string (renders in GitHub markdown)
    render(agent, "fsm.svg")            -> .svg .png .pdf (Graphviz's `dot` program), .dot/.gv, .mmd (none)

Standard states are blue and custom ones amber, final states double circles, each edge labelled with its
guard (dashed: the unguarded default) and reason; with run statistics, each edge's count and share (pen width by
count), each state's mean time, end reasons and failures, and where contexts were rewritten, in violet.
`agent` is a CompiledAgent, an AgentSpec / LoadedSpec, or a spec file path (compiled here).
"""

from __future__ import annotations

import shutil
from collections import deque
from pathlib import Path
from typing import Any

import graphviz

from fsm.run.compile import CompiledAgent, Edge, compile_spec
from fsm.spec.model import STANDARD_STATES

STANDARD_FILL = "#dbeafe"  # blue-100
CUSTOM_FILL = "#fde68a"  # amber-200
FINAL_FILL = "#e5e7eb"  # gray-200
FAILED_COLOR = "#b91c1c"  # red-700
UNUSED_COLOR = "#9ca3af"  # gray-400: an edge no trajectory took
REWRITE_COLOR = "#7c3aed"  # violet-600: an edge (and its state) where segments started
FORMATS = {".svg": "svg", ".png": "png", ".pdf": "pdf"}


class RenderError(Exception):
    """A diagram could not be written (unknown extension, Graphviz's `dot` missing)."""


def _agent(agent: Any) -> CompiledAgent:
    return agent if isinstance(agent, CompiledAgent) else compile_spec(agent)


def flow_order(agent: CompiledAgent) -> list[str]:
    """States breadth-first from the initial one, following edges in declared order."""
    seen, todo = [agent.initial], deque([agent.initial])
    while todo:
        for edge in agent.edges_from.get(todo.popleft(), ()):
            if edge.dest not in seen:
                seen.append(edge.dest)
                todo.append(edge.dest)
    return seen + [s for s in agent.spec.states if s not in seen]


def _edge_stats(edge: Edge, run_stats: dict[str, Any] | None) -> dict[str, Any] | None:
    """This edge's entry in run statistics, if it is the same edge (the spec may have changed since)."""
    if not run_stats:
        return None
    e = run_stats.get("edges", {}).get(str(edge.index))
    if e is None or (e.get("source"), e.get("dest")) != (edge.source, edge.dest):
        return None
    return e


def _seconds(s: float) -> str:
    if s >= 1:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.1f} ms"
    return f"{s * 1e6:.0f} µs"


def _pct(share: float) -> str:
    return f"{share * 100:.0f}%" if share >= 0.01 or share == 0 else f"{share * 100:.1f}%"


def edge_order(agent: CompiledAgent, edge: Edge) -> int | None:
    """1-based position among its state's edges (they are tried in this order), None for a lone edge."""
    siblings = agent.edges_from[edge.source]
    if edge not in siblings:  # a catch rule: taken on a failure, not in the edges' order
        return None
    return siblings.index(edge) + 1 if len(siblings) > 1 else None


def edge_label(
    edge: Edge, stats: dict[str, Any] | None = None, *, sep: str = "\n", order: int | None = None
) -> str:
    """`2. guard`, `reason: ...`, and with statistics `12× · 60%` (count, share of trajectories)."""
    parts = [f"{order}. {edge.label}" if order is not None else edge.label]
    if edge.reason is not None:
        parts.append(f"reason: {edge.reason}")
    if stats is not None:
        parts.append(f"{stats['count']}× · {_pct(stats.get('share', 0.0))}")
        if stats.get("segments"):
            parts.append(f"new segments: {stats['segments']} on {stats['rewrites']}×")
    return sep.join(parts)


def state_lines(agent: CompiledAgent, name: str, run_stats: dict[str, Any] | None) -> list[str]:
    """The lines under a state's name: its action, then run figures."""
    spec, run_stats = agent.spec.states[name], run_stats or {}
    lines = [] if spec.final else [f"{spec.action}()"]
    if spec.policy is not None:
        lines.append(f"policy: {spec.policy}")
    if spec.fork is not None:
        times = "every entry" if spec.fork.times is None else f"{spec.fork.times}x per path"
        made = (run_stats.get("trees") or {}).get("branches", {}).get(name)
        lines.append(f"fork: {spec.fork.branches} branches ({times})" + (f", {made} made" if made else ""))
    s = run_stats.get("states", {}).get(name)
    if s:
        if s.get("mean_s") is not None:
            lines.append(f"{s['visits']} visits, mean {_seconds(s['mean_s'])}")
        ends = run_stats.get("final_states", {}).get(name) or {}
        lines += [f"{reason}: {count}" for reason, count in sorted(ends.items(), key=lambda kv: -kv[1])]
        for key, word in (("failed", "failed"), ("retries", "retries"), ("catches", "caught")):
            if s.get(key):
                lines.append(f"{word}: {s[key]}")
        if s.get("segments"):
            reasons = sorted(s["segment_reasons"].items(), key=lambda kv: -kv[1])
            why = ", ".join(f"{r} {n}" for r, n in reasons)
            lines.append(f"segments started: {s['segments']} ({why})")
    return lines


CHILD_COLOR = "#6a3d9a"  # child machines and the calls that start them


def diagram(agent: Any, run_stats: dict[str, Any] | None = None) -> graphviz.Digraph:
    """The spec as a left-to-right Graphviz digraph; see the module docstring for what is drawn."""
    agent = _agent(agent)
    g = graphviz.Digraph(
        agent.name,
        graph_attr={
            "rankdir": "LR",
            "label": _title(agent, run_stats),
            "labelloc": "t",
            "fontname": "Helvetica",
            "fontsize": "16",
            "nodesep": "0.5",
            "ranksep": "0.9",
        },
        node_attr={"fontname": "Helvetica", "fontsize": "12"},
        edge_attr={"fontname": "Helvetica", "fontsize": "10"},
    )
    g.node("__start__", "", shape="point", width="0.18", tooltip="entry point")
    for name in flow_order(agent):
        spec = agent.spec.states[name]
        lines = state_lines(agent, name, run_stats)
        failed = ((run_stats or {}).get("states", {}).get(name) or {}).get("failed")
        attrs = {"style": "filled", "tooltip": spec.description or name}
        if spec.final:
            attrs.update(shape="doublecircle", fillcolor=FINAL_FILL)
        else:
            custom = name not in STANDARD_STATES
            attrs.update(
                shape="box", style="rounded,filled", fillcolor=CUSTOM_FILL if custom else STANDARD_FILL
            )
            if custom:
                attrs["tooltip"] = f"custom state: {spec.description or name}"
        if failed:
            attrs.update(color=FAILED_COLOR, penwidth="2")
        elif ((run_stats or {}).get("states", {}).get(name) or {}).get("segments"):
            attrs.update(color=REWRITE_COLOR, penwidth="2")
        g.node(name, "\n".join([name, *lines]), **attrs)
    g.edge("__start__", agent.initial, tooltip="initial state")
    counts = [e["count"] for e in (run_stats or {}).get("edges", {}).values()] or [0]
    top = max(counts) or 1
    for edge in agent.edges:
        stats = _edge_stats(edge, run_stats)
        attrs = {
            "label": edge_label(edge, stats, order=edge_order(agent, edge)),
            "tooltip": f"edge #{edge.index}: {edge.source} -> {edge.dest}",
        }
        if edge.catch is not None:
            attrs.update(style="dotted", color=FAILED_COLOR, fontcolor=FAILED_COLOR)
        elif edge.guard is None:
            attrs["style"] = "dashed"
        if stats is not None:
            attrs["penwidth"] = f"{1 + 4 * stats['count'] / top:.2f}"
            if stats["count"] == 0:
                attrs.update(color=UNUSED_COLOR, fontcolor=UNUSED_COLOR)
            elif stats.get("segments"):
                attrs.update(color=REWRITE_COLOR, fontcolor=REWRITE_COLOR)
        g.edge(edge.source, edge.dest, **attrs)
    _child_clusters(g, agent, run_stats)
    return g


def _callers(agent: CompiledAgent) -> list[str]:
    """The states whose action may start a child machine: those that run tool calls."""
    return [name for name, st in agent.spec.states.items() if st.action == "call_tools"] or [agent.initial]


def child_label(agent: CompiledAgent, name: str, run_stats: dict[str, Any] | None) -> str:
    child = agent.spec.children[name]
    made = ((run_stats or {}).get("trees") or {}).get("children", {}).get(name)
    policy = f", policy {child.policy}" if child.policy else ""
    return f"child machine {name}({child.input}): {child.spec}{policy}" + (f"\n{made} nodes" if made else "")


def _child_clusters(g: graphviz.Digraph, agent: CompiledAgent, run_stats: dict[str, Any] | None) -> None:
    """Each child machine as a nested cluster of its own states (statecharts' invoked machine), entered from
    the states that run its tool call; `spec: self` (recursion) as one node pointing back."""
    for name in agent.spec.children:
        label = child_label(agent, name, run_stats)
        try:
            child = agent.child_agent(name)
        except Exception as exc:  # an unloadable child spec is validate's to report: drawn as a node
            child, label = None, f"{label}\n({type(exc).__name__})"
        prefix = f"child_{name}__"  # not "::", which DOT reads as node:port
        with g.subgraph(name=f"cluster_{name}") as c:
            c.attr(label=label, style="rounded,dashed", color=CHILD_COLOR, fontcolor=CHILD_COLOR)
            if child is None or child is agent:
                c.node(prefix + "self", "this machine (recursion)" if child is agent else name, shape="box")
                entry = prefix + "self"
            else:
                for state in flow_order(child):
                    text = "\n".join([state, *state_lines(child, state, None)])
                    shape = "doublecircle" if child.spec.states[state].final else "box"
                    c.node(prefix + state, text, shape=shape, style="rounded")
                for edge in child.edges:
                    style = "dashed" if edge.guard is None else "solid"
                    c.edge(prefix + edge.source, prefix + edge.dest, style=style)
                entry = prefix + child.initial
        for caller in _callers(agent):
            g.edge(caller, entry, label=f"{name}()", style="dotted", color=CHILD_COLOR, fontcolor=CHILD_COLOR)


def _title(agent: CompiledAgent, run_stats: dict[str, Any] | None) -> str:
    title = f"{agent.name}  ({agent.hash})"
    if run_stats:
        title += f"\n{run_stats.get('trajectories', 0)} trajectories"
        segments = run_stats.get("segments") or {}
        if segments.get("rewritten"):  # rows: one per segment
            title += f" ({segments['rewritten']} rewritten), {segments['rows']} segments"
        if run_stats.get("agent_hash") not in (None, agent.hash):
            title += f"; run of spec {run_stats['agent_hash']}: changed edges are not annotated"
    return title


# --- Mermaid --------------------------------------------------------------------------------------------------


_MERMAID_ESCAPES = {ord("#"): "#35;", ord(":"): "#58;", ord(";"): "#59;", ord("\n"): " "}


def _mermaid_text(text: str) -> str:
    """Mermaid ends a label at ':' and ';' and reads '#...;' as an entity: write them as entities."""
    return text.translate(_MERMAID_ESCAPES)


def to_mermaid(agent: Any, run_stats: dict[str, Any] | None = None) -> str:
    """The spec as a Mermaid `stateDiagram-v2` (renders in GitHub markdown and mermaid.live)."""
    agent = _agent(agent)
    title = _mermaid_text(_title(agent, run_stats))
    lines = ["---", f"title: {title}", "---", "stateDiagram-v2", "    direction LR"]
    for name in flow_order(agent):
        extra = state_lines(agent, name, run_stats)
        if extra:  # "S: S" first makes the name the box's title and each later description a line under it
            lines.append(f"    {name}: {name}")
            lines.extend(f"    {name}: {_mermaid_text(line)}" for line in extra)
    lines.append(f"    [*] --> {agent.initial}")
    for edge in agent.edges:
        label = edge_label(edge, _edge_stats(edge, run_stats), sep=" / ", order=edge_order(agent, edge))
        lines.append(f"    {edge.source} --> {edge.dest}: {_mermaid_text(label)}")
    for name in agent.final_states:
        lines.append(f"    {name} --> [*]")
    for name in agent.spec.children:  # child machines as composite states (statecharts' invoke)
        try:
            child = agent.child_agent(name)
        except Exception:
            child = None
        box = f"child_{name}"
        lines.append(f'    state "{_mermaid_text(child_label(agent, name, run_stats))}" as {box} {{')
        if child is None or child is agent:
            lines.append(f"        {box}_self: {'this machine (recursion)' if child is agent else name}")
        else:
            lines.append(f"        [*] --> {box}_{child.initial}")
            for edge in child.edges:
                lines.append(f"        {box}_{edge.source} --> {box}_{edge.dest}")
        lines.append("    }")
        for caller in _callers(agent):
            lines.append(f"    {caller} --> {box}: {_mermaid_text(name + '()')}")
    custom = [s for s in flow_order(agent) if s not in STANDARD_STATES and s not in agent.final_states]
    lines.append(f"    classDef standard fill:{STANDARD_FILL}")
    lines.append(f"    classDef custom fill:{CUSTOM_FILL}")
    lines.append(f"    classDef final fill:{FINAL_FILL}")
    standard = [s for s in flow_order(agent) if s in STANDARD_STATES and s not in agent.final_states]
    for cls, names in (("standard", standard), ("custom", custom), ("final", sorted(agent.final_states))):
        if names:
            lines.append(f"    class {','.join(names)} {cls}")
    return "\n".join(lines) + "\n"


# --- files ----------------------------------------------------------------------------------------------------


def render(agent: Any, path: str | Path, run_stats: dict[str, Any] | None = None) -> Path:
    """Write the diagram; the format follows the extension: .svg .png .pdf (need Graphviz's `dot`),
    .dot/.gv (DOT source) or .mmd (Mermaid), which need nothing."""
    path = Path(path)
    ext = path.suffix.lower()
    if ext in (".dot", ".gv"):
        path.write_text(diagram(agent, run_stats).source, encoding="utf-8")
    elif ext == ".mmd":
        path.write_text(to_mermaid(agent, run_stats), encoding="utf-8")
    elif ext in FORMATS:
        graph = diagram(agent, run_stats)
        if shutil.which("dot") is None:
            raise RenderError(
                f"writing {path.name} needs Graphviz's `dot` program, which is not on PATH: install "
                "graphviz (apt-get install graphviz, brew install graphviz or conda install graphviz), "
                "or write .dot or .mmd instead, which need nothing"
            )
        if ext == ".png":
            graph.graph_attr["dpi"] = "144"  # sharp on high-density screens and in READMEs
        try:
            path.write_bytes(graph.pipe(format=FORMATS[ext]))
        except graphviz.ExecutableNotFound as exc:
            raise RenderError(
                f"Graphviz's `dot` could not run ({exc}): install graphviz (apt-get install graphviz)"
            ) from exc
    else:
        raise RenderError(
            f"{path.name}: unknown diagram format {ext or '(none)'!r}; use .svg, .png, .pdf, .dot or .mmd"
        )
    return path
