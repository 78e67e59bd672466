"""Trees: child machines and forks (docs/trees.md).

A trajectory is a tree of nodes (`Node`, fsm/run/trajectory.py); a linear spec's tree is its root alone. A child machine is
started by a tool call named after it (`children:` in the spec): the child runs its own spec, policy and limits
from the call's task and its final answer is the call's observation. A fork
(`fork:` on a state) copies the trajectory into K branches on entering the state; the forking node stops there
and every branch runs the state's action on its own, so the tokens before the fork are generated once. Children
and branches run in tasks owned by the parent's action (a TaskGroup): cancelling the parent cancels its subtree.
The runner calls this module at fixed points (`enter`, `finish`, `reward_of`, `end`, at the end of the file), so
its driver loop reads the same for a linear row and a tree's node.

`validate`'s checks of a spec's trees come first (`check_tree`, `tree_size`, `child_schema`): policies named and
used, child machines that exist and cannot recurse without a bound (forks on a cycle: fsm/run/compile.py), each
reported at its line through the compiler's `error(code, message, *loc)`.
"""

from __future__ import annotations

import asyncio
import re
from array import array
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fsm.data.rows import RowError
from fsm.run.agent import child_spec_path
from fsm.run.trajectory import Metrics, Node, TokenRuns, Trajectory, TreeCount
from fsm.spec.loader import SpecError, load_spec
from fsm.spec.model import AgentSpec
from fsm.tools.base import CallOutcome

if TYPE_CHECKING:
    from fsm.families.parsers import ToolCall
    from fsm.run.context import RunContext

Drive = Callable[["RunContext", Trajectory], Coroutine[Any, Any, None]]
# a child call refused by the run's node bound: the row's error (fsm/run/actions.py), not the model's observation
RUN_NODE_BOUND = "run_node_bound"


def child_schema(name: str, spec: Any, given: Any = None) -> dict[str, Any]:
    """The tool schema the parent's model sees for child machine `name`: `given` (the spec's `schema:`, renamed
    to the child's name), else one text argument."""
    if isinstance(given, dict):
        function = {**given.get("function", given), "name": name}
    else:
        task = {spec.input: {"type": "string", "description": "The task for the sub-agent."}}
        parameters = {"type": "object", "properties": task, "required": [spec.input]}
        function = {"name": name, "description": spec.description, "parameters": parameters}
    return {"type": "function", "function": function}


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


def check_tree(
    spec: AgentSpec, path: Path | None, error: Callable[..., None], tool_names: set[str] | None = None
) -> None:
    """Every tree check of `spec` (loaded from `path`, None when built in memory); `tool_names`: its built tools'
    names (default: `declared_tool_names`, what a static check knows)."""
    declared = set(spec.policies) or {"default"}
    generating = any(st.action == "generate" or st.policy for st in spec.states.values())
    named: dict[str, str] = {}
    for name, st in spec.states.items():
        if st.policy is None:
            continue
        if st.policy not in declared:
            msg = f"state {name} names policy {st.policy!r}, not under policies: ({', '.join(sorted(declared))})"
            error("unknown-policy", msg, "states", name, "policy", key=False)
        named.setdefault(st.policy, name)
    if len(named) > 1:
        (a, sa), (b, sb) = list(named.items())[:2]
        msg = f"states {sa} and {sb} generate with two policies ({a}, {b}); one machine's rows belong to one "
        msg += "policy: start a child machine (children:) for the other"
        error("mixed-policy", msg, "states", sb, "policy", key=False)
    used = ({spec.policy} if generating else set()) | set(named)
    if tool_names is None:
        tool_names = declared_tool_names(spec)
    for name, child in spec.children.items():
        if name in tool_names:
            msg = f"child machine {name!r} has the name of a tool: the model would see two tools named {name!r} "
            msg += "and a call could reach either; rename one (the tool's `name:` or the child's key)"
            error("duplicate", msg, "children", name)
        if child.policy is not None:
            if child.policy not in declared:
                msg = f"child machine {name} names policy {child.policy!r}, not under policies: "
                msg += f"({', '.join(sorted(declared))})"
                error("unknown-policy", msg, "children", name, "policy", key=False)
            used.add(child.policy)
        target = child_spec_path(child.spec, path)
        if target is None:
            used.add(spec.policy)
            continue
        loaded = _load(target) if target.is_file() else None
        if loaded is None:
            why = "no such file" if not target.is_file() else "it does not load (run validate on it)"
            msg = f"child machine {name}: spec {child.spec!r} ({target}): {why}"
            error("unknown-child", msg, "children", name, "spec", key=False)
        elif child.policy is None:
            used.add(loaded.policy)
    for name in spec.policies:
        if name not in used:
            msg = f"policy {name} generates nowhere: no state or child machine uses it"
            error("unused-policy", msg, "policies", name)
    if spec.children and spec.tree.max_depth is None and _recursive(spec, path):
        msg = "a child machine starts this spec again (directly or through others) and tree.max_depth is null"
        error("unbounded-recursion", f"{msg}: set a bound", "tree", "max_depth", key=False)


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


def _charge(ctx: RunContext, count: TreeCount, k: int) -> str | None:
    """Charge `k` new nodes of a tree to the run's bound: why not (None: charged). Unlike a tree's own bounds,
    which the tree lives with, the run's protects the machine, so passing it ends the row as an error."""
    limit = ctx.root_agent.spec.tree.max_run_nodes
    held = ctx.run_nodes.nodes
    if held + k > limit:
        return (
            f"tree.max_run_nodes {limit} reached: the run's trees in flight hold {held} children and branches, "
            f"this one would add {k}; bound the spec's trees (agentfsm validate says how many nodes one can "
            "reach) or raise tree.max_run_nodes"
        )
    ctx.run_nodes.nodes += k
    count.run += k
    return None


def root_node(traj: Trajectory, agent: Any) -> Node:
    """The root's Node, bound to the agent it runs when its tree grows (a linear row's needs none)."""
    node = traj.node
    if node.agent is None:
        node.policy, node.agent, node.root_agent = agent.spec.policy, agent, agent
    return node


def _room(parent: Node, root_agent: Any, k: int = 1) -> str | None:
    """Why `parent` may not grow `k` more nodes (None: it may)."""
    tree = root_agent.spec.tree
    if tree.max_depth is not None and parent.depth + 1 > tree.max_depth:
        return f"tree.max_depth {tree.max_depth} reached"
    if len(parent.nodes) + k > tree.max_children:
        return f"tree.max_children {tree.max_children} reached"
    if parent.count.nodes + k > tree.max_nodes:
        return f"tree.max_nodes {tree.max_nodes} reached"
    return None


def nodes_of(traj: Trajectory) -> list[Trajectory]:
    """The tree of `traj` in preorder (a node, then its children and branches, each with its own subtree)."""
    out = [traj]
    for sub in traj.node.nodes:
        out += nodes_of(sub)
    return out


def row_nodes(traj: Trajectory) -> list[Trajectory]:
    """The nodes of `traj`'s tree that are training rows: all but those that forked."""
    return [t for t in nodes_of(traj) if not t.node.forked]


def tree_fields(traj: Any, k: int) -> dict[str, Any] | None:
    """Segment `k`'s place in a gateway session's tree, where the trajectory has one (`extra["tree"]`, one dict
    per row: fsm/gateway/tree.py); None otherwise, or when the rows changed since (a row failed)."""
    rows = getattr(traj, "extra", {}).get("tree")
    if not rows or len(rows) != len(traj.closed) + 1:
        return None
    return dict(rows[k])


def tree_record(t: Trajectory, segment: int = 0, default: str = "default") -> dict[str, Any]:
    """Where a row sits in its tree (docs/trees.md): the fields of trajectories.jsonl and the batch's columns,
    but `weight`. A gateway session's rows say where they sit (`tree_fields`); a root's policy is its run's
    spec's, `default` (a root read back from a journal is bound to no agent)."""
    if (recorded := tree_fields(t, segment)) is not None:
        recorded.pop("weight")
        return recorded
    n = t.node
    out = n.fields(n.shared_length if segment == 0 else 0)
    if n.kind == "root":
        out["policy"] = default
    return out


# --- child machines ---------------------------------------------------------------------------------------


def final_answer(traj: Trajectory) -> str | None:
    """A finished child's answer: the text of its last model turn's message; None when it has none."""
    for message in reversed(traj.messages):
        if message.get("role") == "assistant":
            content = message.get("content")
            return content if isinstance(content, str) else None
    return None


def _new_child(
    traj: Trajectory, parent: Node, path: str, call: tuple[str, Any, str], agent: Any, policy: str
) -> Trajectory:
    """Child machine `call` = (name, its spec, the task)'s node, before its first action, appended to `parent`'s
    nodes."""
    name, child_spec, task = call
    messages = ([{"role": "system", "content": child_spec.system}] if child_spec.system else []) + [
        {"role": "user", "content": child_spec.task.replace("{input}", task)}
    ]
    row = {"raw_prompt": messages, "uid": traj.uid, "data_source": traj.row.get("data_source")}
    child = Trajectory(traj.index, traj.sample, f"{traj.session_id}:{path}", traj.uid, row, agent.initial)
    child.extra["row_name"] = f"{traj.row_name} node {path}"
    child.tool_schemas = agent.tools.schemas_for(None)
    parent.count.nodes += 1
    offset = len(traj.prompt_ids) + len(traj.response_ids)
    child.node = _node(
        parent, path, "child", offset, policy, origin=name, route=child.session_id, agent=agent
    )
    parent.nodes.append(child)
    return child


def _node(parent: Node, path: str, kind: str, offset: int, policy: str, **run: Any) -> Node:
    """Node `path` below `parent`, in its tree, numbered there (counted already); `run`: its own run state, where
    it is not its parent's."""
    run = {"root_agent": parent.root_agent, "route": parent.route, "agent": parent.agent, **run}
    run.update(count=parent.count, ordinal=parent.count.nodes - 1)
    return Node(parent.tree, path, parent.node, kind, offset, policy, parent.depth + 1, **run)


def _taken_back(parent: Node, path: str, kind: str, origin: str | None) -> Trajectory | None:
    """A resumed tree's node at `path` that the journal holds (made after `parent`'s last state boundary, which
    its action, run again, reaches once more): None when there is none, or it is not what the action makes."""
    if not parent.pending:
        return None
    traj = parent.pending.pop(path, None)
    if traj is None or traj.node.kind != kind or traj.node.origin != origin:
        return None
    return traj


async def run_child(ctx: RunContext, traj: Trajectory, call: ToolCall, drive: Drive) -> CallOutcome:
    """The tool call `call` of `traj` names a child machine: run it and answer with its final answer, or with
    an error observation (refused by a bound, failed, no answer). Never raises for the child's own failures."""
    name = call.name or "?"
    child_spec = ctx.agent.spec.children[name]
    root_agent = ctx.root_agent
    parent = root_node(traj, ctx.agent)
    task = (call.arguments or {}).get(child_spec.input) if isinstance(call.arguments, dict) else None

    def refused(text: str, error: str) -> CallOutcome:
        return CallOutcome(name, text, error=error, call_id=call.id)

    if not isinstance(task, str) or not task.strip():
        return refused(f"Error: {name} needs a text argument {child_spec.input!r}", "bad_arguments")
    why = _room(parent, root_agent)
    if why is not None:
        return refused(f"Error: sub-agent {name} not started: {why}", "tree_limit")
    over = _charge(ctx, parent.count, 1)
    if over is not None:
        return refused(f"sub-agent {name} not started: {over}", RUN_NODE_BOUND)
    agent = ctx.child_agent(name)
    policy = child_spec.policy or agent.spec.policy
    child_ctx = ctx.for_node(agent, policy)
    node_path = f"{parent.node}.{len(parent.nodes)}"
    child = _taken_back(parent, node_path, "child", name)
    if child is None:
        child = _new_child(traj, parent, node_path, (name, child_spec, task), agent, policy)
    else:
        parent.count.nodes += 1
        parent.nodes.append(child)
    if not child.node.finished:
        async with asyncio.TaskGroup() as tg:  # its own task: the parent's cancellation reaches it
            tg.create_task(drive(child_ctx, child))
    if child.failed:
        return refused(f"Error: sub-agent {name} failed: {child.termination_reason}", "child_failed")
    answer = final_answer(child)
    if answer is None:
        return refused(
            f"Error: sub-agent {name} ended ({child.termination_reason}) without an answer", "child_no_answer"
        )
    if child_spec.answer is not None and (m := re.search(child_spec.answer, answer)) is not None:
        answer = m.group(1) if m.groups() else m.group(0)
    return CallOutcome(name, answer, reward=None, call_id=call.id)


# --- forks ------------------------------------------------------------------------------------------------


def _copy(traj: Trajectory, session_id: str) -> Trajectory:
    """A branch of `traj`: every token, message and counter so far, copied (the branch appends to its own)."""
    b = Trajectory(traj.index, traj.sample, session_id, traj.uid, traj.row, traj.state)
    b.messages = list(traj.messages)
    b.tool_schemas, b.tools_kwargs = traj.tool_schemas, dict(traj.tools_kwargs)
    b.interaction_kwargs = traj.interaction_kwargs
    b.prompt_ids, b.response_ids = array("i", traj.prompt_ids), array("i", traj.response_ids)
    b.response_mask, b.response_logprobs = array("b", traj.response_mask), array("f", traj.response_logprobs)
    b._version_runs, b.runs = array("i", traj._version_runs), TokenRuns(traj.runs)
    b.closed = list(traj.closed) if traj.closed else ()
    b.segment_start, b.needs_tail = traj.segment_start, traj.needs_tail
    b.logprobs_missing = traj.logprobs_missing
    b.path, b.path_times = list(traj.path), array("d", traj.path_times)
    b.transitions_fired = list(traj.transitions_fired)
    b.assistant_turns, b.user_turns = traj.assistant_turns, traj.user_turns
    b.pending_calls, b.last_finish_reason = list(traj.pending_calls), traj.last_finish_reason
    b.failures = list(traj.failures)  # its own list: a failure handled in one branch is not its siblings'
    b.should_terminate, b.observation_overflow = traj.should_terminate, traj.observation_overflow
    b.termination_reason = traj.termination_reason
    b.tool_rewards, b.tool_scores = list(traj.tool_rewards), list(traj.tool_scores)
    b.turn_scores, b.turn_rewards = list(traj.turn_scores), [list(r) for r in traj.turn_rewards]
    b.metrics, b.extra_fields = Metrics(), dict(traj.extra_fields)
    # lists its own (a failure handled in one branch is not its siblings'); the rest is read only
    b.extra = {k: list(v) if isinstance(v, list) else v for k, v in traj.extra.items()}
    return b


async def fork(ctx: RunContext, traj: Trajectory, drive: Drive) -> bool:
    """Fork `traj` into its state's branches and drive them to their ends (concurrently, on the same server as
    `traj`: they share its routing key). False when a tree bound refuses it (then `traj` goes on alone)."""
    spec = ctx.agent.forks[traj.state]
    root_agent = ctx.root_agent
    parent = root_node(traj, ctx.agent)
    k = spec.branches
    if _room(parent, root_agent, k) is not None:
        tree = root_agent.spec.tree
        bounds = f"max_depth {tree.max_depth}, max_children {tree.max_children}, max_nodes {tree.max_nodes}"
        traj.extra["fork_refused"] = f"{traj.state}: {k} branches past tree bounds ({bounds})"
        parent.forks[traj.state] = parent.forks.get(traj.state, 0) + 1
        return False
    over = _charge(ctx, parent.count, k)
    if over is not None:
        raise RowError(f"fork of {k} branches in {traj.state}: {over}", "fork")
    offset = len(traj.prompt_ids) + len(traj.response_ids)
    branches = []
    for _ in range(k):
        path = f"{parent.node}.{len(parent.nodes)}"
        kept = _taken_back(parent, path, "branch", traj.state)
        parent.count.nodes += 1
        if kept is not None:  # a resumed tree's branch: as the journal holds it
            parent.nodes.append(kept)
            branches.append(kept)
            continue
        b = _copy(traj, f"{traj.session_id}:{path}")
        forks = {**parent.forks, traj.state: parent.forks.get(traj.state, 0) + 1}
        run = dict(origin=traj.state, shared_length=offset, forks=forks, root_agent=root_agent, fresh=True)
        b.node = _node(parent, path, "branch", offset, parent.policy, **run)
        b.extra["row_name"] = f"{traj.row_name} node {path}"
        parent.nodes.append(b)
        branches.append(b)
    parent.forked = True
    drive = ctx.drive or drive  # a kept run's: each branch journaled at its own boundaries
    async with asyncio.TaskGroup() as tg:
        for b in branches:
            if not b.node.finished:
                tg.create_task(drive(ctx, b))
    return True


# --- the runner's fixed points (fsm/run/runtime.py): a linear row passes each at the cost of a check ----------


async def enter(ctx: RunContext, traj: Trajectory, drive: Drive) -> bool:
    """`traj` enters its state: True when it forked there (the state has `fork:` this path has not used up; its
    branches went on from here, to their ends)."""
    if not ctx.agent.forks:
        return False
    spec = ctx.agent.forks.get(traj.state)
    if traj.node.fresh:  # copied at this entry: the branch's own turn comes now
        traj.node.fresh = False
        return False
    if spec is None or traj.interaction_started:  # a user simulator's session cannot be split
        return False
    if spec.times is not None and traj.node.forks.get(traj.state, 0) >= spec.times:
        return False
    return await fork(ctx, traj, drive)


async def finish(ctx: RunContext, traj: Trajectory) -> bool:
    """A node that forked is finished by its branches (True): it has no row of its own, and is scored as their
    mean. False for any other, which the runner finishes itself."""
    node = traj.node
    if not node.forked or traj.failed:
        return False
    traj.termination_reason = "forked"
    scores = [t.reward_score for t in node.nodes if t.reward_score is not None]
    traj.reward_score = sum(scores) / len(scores) if scores else None
    await ctx.backend.release(traj.session_id)
    return True


def reward_of(ctx: RunContext, traj: Trajectory) -> Any:
    """The reward function that scores `traj`: its spec's, but none for a child machine's row, which gets its
    tree's when the root ends (`end`)."""
    return None if traj.node.kind == "child" else ctx.agent.reward


def end(ctx: RunContext, traj: Trajectory) -> None:
    """`traj` was driven to its end. A root's tree is done: each of its rows without a reward of its own (a child
    machine's) gets the root's, the tree's outcome, and its nodes no longer count against the run's
    `tree.max_run_nodes`."""
    if traj.node.kind != "root":
        return
    if traj.reward_score is not None:
        for sub in row_nodes(traj):
            if sub.reward_score is None:
                sub.reward_score = traj.reward_score
    count = traj.node.count
    ctx.run_nodes.nodes = max(ctx.run_nodes.nodes - count.run, 0)
    count.run = 0
