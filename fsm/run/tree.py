"""Trees: child machines and forks (docs/trees.md).

A trajectory is a tree of nodes; a linear spec's tree is its root alone and carries no `Node` (nothing extra per
trajectory). A child machine is started by a tool call named after it (`children:` in the spec): the child runs
its own spec, policy and limits from the call's task and its final answer is the call's observation. A fork
(`fork:` on a state) copies the trajectory into K branches on entering the state; the forking node stops there
and every branch runs the state's action on its own, so the tokens before the fork are generated once. Children
and branches run in tasks owned by the parent's action (a TaskGroup): cancelling the parent cancels its subtree.
"""

from __future__ import annotations

import asyncio
import re
from array import array
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fsm.data.rows import RowError
from fsm.run.trajectory import Metrics, TokenRuns, Trajectory
from fsm.tools.base import CallOutcome

if TYPE_CHECKING:
    from fsm.families.parsers import ToolCall
    from fsm.run.context import RunContext

Drive = Callable[["RunContext", Trajectory], Coroutine[Any, Any, None]]


@dataclass(slots=True)
class TreeCount:
    """What one tree shares: its node count, against the root spec's `tree.max_nodes`."""

    nodes: int = 1
    run: int = 0  # of them, charged to the run's `tree.max_run_nodes` (released when the root ends)


# a child call refused by the run's node bound: the row's error (fsm/run/actions.py), not the model's observation
RUN_NODE_BOUND = "run_node_bound"


def _charge(ctx: RunContext, count: TreeCount, k: int) -> str | None:
    """Charge `k` new nodes of a tree to the run's bound: why not (None: charged). Unlike a tree's own bounds,
    which the tree lives with, the run's protects the machine (a bomb of 100,000 nodes within one tree's), so
    passing it ends the row as an error."""
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


def release_nodes(ctx: RunContext, traj: Trajectory) -> None:
    """A root ended: its tree's nodes no longer count against the run's `tree.max_run_nodes`."""
    node = traj.node
    if node is not None and node.kind == "root":
        ctx.run_nodes.nodes = max(ctx.run_nodes.nodes - node.count.run, 0)
        node.count.run = 0


@dataclass(eq=False, slots=True)
class Node:
    """A node of a tree: where its rows sit (`fields`: the row fields of docs/trees.md) and the nodes it made.
    The one model of the engine's trees (child machines and forks, whose run state follows) and of the gateway's
    session trees (fsm/gateway/tree.py adds how a session's segments are recorded)."""

    tree: str  # the root trajectory's session id: unique per sample
    node: str = "0"  # "0" the root, "0.1" its second child or branch, ...
    parent: str | None = None
    kind: str = "root"  # "root" | "child" | "branch" (the gateway's auxiliary calls: their kind, "title" ...)
    branch_offset: int = 0  # tokens of the parent (prompt + response) before this node began
    policy: str = "default"
    depth: int = 0
    # children and branches, in creation order: their trajectories in the engine, their nodes in the gateway
    nodes: list[Any] = field(default_factory=list)
    origin: str | None = None  # what made it: its child machine's name, or the state that forked
    # --- the engine's run state ---
    shared_length: int = 0  # tokens this node's row shares exactly with its parent's
    route: str = ""  # the sticky routing key: a branch keeps its parent's, so it goes to the same server
    agent: Any = None  # the CompiledAgent this node runs
    count: TreeCount = field(default_factory=TreeCount)
    ordinal: int = 0  # the node's number in its tree, creation order (distinct sampling seeds)
    forks: dict[str, int] = field(default_factory=dict)  # state -> forks there along this path
    forked: bool = False  # it split into branches: its tokens live on in theirs, it has no row of its own
    root_agent: Any = None  # the root's CompiledAgent: its `tree:` bounds the whole tree
    # a resumed tree (fsm/run/treejournal.py): nodes the journal holds that were made after this node's last
    # state boundary, by path, for its re-run action to take back instead of making them again; and whether
    # this node had finished (taken back as it is, never run again)
    pending: dict[str, Trajectory] | None = None
    finished: bool = False
    # a branch at the entry it was copied at: it runs that state's action, it does not fork there again (each copy
    # would fork anew, 2 + 4 + 8 ... nodes where `branches: 2` was declared); journaled, so a resume knows it too
    fresh: bool = False

    def fields(self, shared: int = 0) -> dict[str, Any]:
        """Its rows' place in the tree (TREE_FIELDS but `weight`), for a row whose first `shared` tokens are
        its parent's."""
        return {
            "tree": self.tree,
            "node": self.node,
            "parent": self.parent,
            "node_kind": self.kind,
            "branch_offset": self.branch_offset,
            "policy": self.policy,
            "depth": self.depth,
            "shared_prefix": {"length": shared, "node": self.parent if shared else None},
        }


def root_node(traj: Trajectory, agent: Any) -> Node:
    """The root's Node, made when the tree grows (a linear trajectory never gets one)."""
    node: Node | None = traj.node
    if node is None:
        node = traj.node = Node(
            traj.session_id, policy=agent.spec.policy, route=traj.session_id, agent=agent, root_agent=agent
        )
    return node


def _room(parent: Node, root_agent: Any) -> str | None:
    """Why `parent` may not grow one more node (None: it may)."""
    tree = root_agent.spec.tree
    if tree.max_depth is not None and parent.depth + 1 > tree.max_depth:
        return f"tree.max_depth {tree.max_depth} reached"
    if len(parent.nodes) >= tree.max_children:
        return f"tree.max_children {tree.max_children} reached"
    if parent.count.nodes >= tree.max_nodes:
        return f"tree.max_nodes {tree.max_nodes} reached"
    return None


def nodes_of(traj: Trajectory) -> list[Trajectory]:
    """The tree of `traj` in preorder (a node, then its children and branches, each with its own subtree)."""
    if traj.node is None:
        return [traj]
    out = [traj]
    for sub in traj.node.nodes:
        out += nodes_of(sub)
    return out


def row_nodes(traj: Trajectory) -> list[Trajectory]:
    """The nodes of `traj`'s tree that are training rows: all but those that forked."""
    return [t for t in nodes_of(traj) if t.node is None or not t.node.forked]


TREE_FIELDS = (
    "tree",
    "node",
    "parent",
    "node_kind",
    "branch_offset",
    "policy",
    "depth",
    "weight",
    "shared_prefix",
)


def tree_fields(traj: Any, k: int) -> dict[str, Any] | None:
    """Segment `k`'s place in a gateway session's tree, where the trajectory has one (`extra["tree"]`, one dict
    per row, TREE_FIELDS: fsm/gateway/tree.py); None otherwise, or when the rows changed since (a row failed)."""
    rows = getattr(traj, "extra", {}).get("tree")
    if not rows or len(rows) != len(traj.closed) + 1:
        return None
    return dict(rows[k])


def tree_record(t: Trajectory, segment: int = 0, default: str = "default") -> dict[str, Any]:
    """Where a row sits in its tree (docs/trees.md): the fields of trajectories.jsonl and the batch's columns,
    but `weight`. A linear trajectory is its tree's root; a gateway session's rows say where they sit
    (`tree_fields`)."""
    n = t.node
    if n is None and (recorded := tree_fields(t, segment)) is not None:
        recorded.pop("weight")
        return recorded
    if n is None:
        return {
            "tree": t.session_id,
            "node": "0",
            "parent": None,
            "node_kind": "root",
            "branch_offset": 0,
            "policy": default,
            "depth": 0,
            "shared_prefix": {"length": 0, "node": None},
        }
    return n.fields(n.shared_length if segment == 0 else 0)


# --- child machines ---------------------------------------------------------------------------------------


def final_answer(traj: Trajectory) -> str | None:
    """A finished child's answer: the text of its last model turn's message; None when it has none."""
    for message in reversed(traj.messages):
        if message.get("role") == "assistant":
            content = message.get("content")
            return content if isinstance(content, str) else None
    return None


def _new_child(
    traj: Trajectory, parent: Node, node_path: str, call: tuple[str, Any, str], agent: Any, policy: str
) -> Trajectory:
    """Child machine `call` = (name, its spec, the task)'s node, before its first action, appended to `parent`'s
    nodes."""
    name, child_spec, task = call
    messages = ([{"role": "system", "content": child_spec.system}] if child_spec.system else []) + [
        {"role": "user", "content": child_spec.task.replace("{input}", task)}
    ]
    row = {"raw_prompt": messages, "uid": traj.uid, "data_source": traj.row.get("data_source")}
    child = Trajectory(
        traj.index, traj.sample, f"{traj.session_id}:{node_path}", traj.uid, row, agent.initial
    )
    child.extra["row_name"] = f"{traj.row_name} node {node_path}"
    child.tool_schemas = agent.tools.schemas_for(None)
    parent.count.nodes += 1
    child.node = Node(
        parent.tree,
        node_path,
        parent.node,
        "child",
        len(traj.prompt_ids) + len(traj.response_ids),
        policy,
        parent.depth + 1,
        origin=name,
        route=child.session_id,
        agent=agent,
        count=parent.count,
        ordinal=parent.count.nodes - 1,
        root_agent=parent.root_agent,
    )
    parent.nodes.append(child)
    return child


def _taken_back(parent: Node, path: str, kind: str, origin: str | None) -> Trajectory | None:
    """A resumed tree's node at `path` that the journal holds (made after `parent`'s last state boundary, which
    its action, run again, reaches once more): None when there is none, or it is not what the action makes."""
    if not parent.pending:
        return None
    traj = parent.pending.pop(path, None)
    if traj is None or traj.node is None or traj.node.kind != kind or traj.node.origin != origin:
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
    if not isinstance(task, str) or not task.strip():
        return CallOutcome(
            name,
            f"Error: {name} needs a text argument {child_spec.input!r}",
            error="bad_arguments",
            call_id=call.id,
        )
    why = _room(parent, root_agent)
    if why is not None:
        return CallOutcome(
            name, f"Error: sub-agent {name} not started: {why}", error="tree_limit", call_id=call.id
        )
    over = _charge(ctx, parent.count, 1)
    if over is not None:
        return CallOutcome(
            name, f"sub-agent {name} not started: {over}", error=RUN_NODE_BOUND, call_id=call.id
        )
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
        return CallOutcome(
            name,
            f"Error: sub-agent {name} failed: {child.termination_reason}",
            error="child_failed",
            call_id=call.id,
        )
    answer = final_answer(child)
    if answer is None:
        return CallOutcome(
            name,
            f"Error: sub-agent {name} ended ({child.termination_reason}) without an answer",
            error="child_no_answer",
            call_id=call.id,
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
    b.segment_start, b.needs_tail, b.logprobs_missing = (
        traj.segment_start,
        traj.needs_tail,
        traj.logprobs_missing,
    )
    b.path, b.path_times = list(traj.path), array("d", traj.path_times)
    b.transitions_fired = list(traj.transitions_fired)
    b.assistant_turns, b.user_turns = traj.assistant_turns, traj.user_turns
    b.pending_calls, b.last_finish_reason = list(traj.pending_calls), traj.last_finish_reason
    b.should_terminate, b.observation_overflow = traj.should_terminate, traj.observation_overflow
    b.termination_reason = traj.termination_reason
    b.tool_rewards, b.tool_scores = list(traj.tool_rewards), list(traj.tool_scores)
    b.turn_scores, b.turn_rewards = list(traj.turn_scores), [list(r) for r in traj.turn_rewards]
    b.metrics, b.extra_fields = Metrics(), dict(traj.extra_fields)
    # lists its own (a failure handled in one branch is not its siblings'); the rest is read only
    b.extra = {k: list(v) if isinstance(v, list) else v for k, v in traj.extra.items()}
    return b


def should_fork(ctx: RunContext, traj: Trajectory) -> bool:
    """`traj`, entering its state, forks there now: the state has `fork:` and this path has not used it up."""
    fork = ctx.agent.forks.get(traj.state)
    if traj.node is not None and traj.node.fresh:  # copied at this entry: the branch's own turn comes now
        traj.node.fresh = False
        return False
    if fork is None or traj.interaction_started:  # a user simulator's session cannot be split
        return False
    done = traj.node.forks.get(traj.state, 0) if traj.node is not None else 0
    return fork.times is None or done < fork.times


async def fork(ctx: RunContext, traj: Trajectory, drive: Drive) -> bool:
    """Fork `traj` into its state's branches and drive them to their ends (concurrently, on the same server as
    `traj`: they share its routing key). False when a tree bound refuses it (then `traj` goes on alone)."""
    spec = ctx.agent.forks[traj.state]
    root_agent = ctx.root_agent
    parent = root_node(traj, ctx.agent)
    k = spec.branches
    tree = root_agent.spec.tree
    if (
        (tree.max_depth is not None and parent.depth + 1 > tree.max_depth)
        or len(parent.nodes) + k > tree.max_children
        or parent.count.nodes + k > tree.max_nodes
    ):
        traj.extra["fork_refused"] = (
            f"{traj.state}: {k} branches past tree bounds (max_depth {tree.max_depth}, max_children "
            f"{tree.max_children}, max_nodes {tree.max_nodes})"
        )
        parent.forks[traj.state] = parent.forks.get(traj.state, 0) + 1
        return False
    over = _charge(ctx, parent.count, k)
    if over is not None:
        raise RowError(f"fork of {k} branches in {traj.state}: {over}")
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
        b.node = Node(
            parent.tree,
            path,
            parent.node,
            "branch",
            offset,
            parent.policy,
            parent.depth + 1,
            origin=traj.state,
            shared_length=offset,
            route=parent.route,
            agent=parent.agent,
            count=parent.count,
            ordinal=parent.count.nodes - 1,
            forks={**parent.forks, traj.state: parent.forks.get(traj.state, 0) + 1},
            root_agent=root_agent,
            fresh=True,
        )
        b.extra["row_name"] = f"{traj.row_name} node {path}"
        parent.nodes.append(b)
        branches.append(b)
    parent.forked = True
    drive = ctx.drive or drive  # a kept run's: each branch journaled at its own boundaries
    async with asyncio.TaskGroup() as tg:
        for b in branches:
            if b.node is not None and not b.node.finished:
                tg.create_task(drive(ctx, b))
    return True
