"""Tree nodes in the run journal (fsm/run/journal.py), so that a tree run resumes as a linear one does.

Every node (child machine, branch) is journaled as a root is: whole at its first state boundary (`child_started`,
`fork`), then the event of each boundary, `done` when it finished; its place in the tree rides along as `n` (its
path, parent, kind, branch offset, policy, depth, shared prefix, routing key, ordinal, fork counts, origin, `k`: how
many nodes it had made at that boundary, and `fresh`: a branch still at the entry it was copied at, which it does
not fork at again), written again whenever `k`, its fork counts, `forked` or `fresh` changed. A node's session
id is `<root's>:<path>`, and its path is the parent's plus its creation number, so ids are the same in any run
of the same row.

On resume (fsm/run/resume.py), a tree is put back as it was at each node's last boundary: a parent's first `k`
nodes hang under it as they were (finished or going on from their own last boundary); those made later are
`pending`, taken back by the parent's action when it runs again (fsm/run/tree.py `run_child`, `fork`) instead
of being made anew: a finished one is never run again (a child's observation to its parent is its journaled
final answer), an unfinished one goes on from its last boundary. So the nodes redone are those in flight, as
for linear rows. A node record that does not fit its tree is refused as strictly as a linear record.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import Any

from fsm.run.codec import decode_trajectory, decoded, from_whole
from fsm.run.snapcheck import _check
from fsm.run.trajectory import Node, Trajectory, TreeCount
from fsm.run.tree import root_node, row_nodes

META = (
    "node",
    "parent",
    "kind",
    "offset",
    "policy",
    "depth",
    "shared",
    "route",
    "ordinal",
    "forks",
    "origin",
    "k",
    "forked",
    "fresh",
)
_PATH = re.compile(r"0(\.(0|[1-9]\d{0,5}))*")


def node_meta(node: Node) -> dict[str, Any]:
    """A node's place in its tree, as the journal's `n` holds it."""
    return {
        "node": node.node,
        "parent": node.parent,
        "kind": node.kind,
        "offset": node.branch_offset,
        "policy": node.policy,
        "depth": node.depth,
        "shared": node.shared_length,
        "route": node.route,
        "ordinal": node.ordinal,
        "forks": dict(node.forks),
        "origin": node.origin,
        "k": len(node.nodes),
        "forked": node.forked,
        "fresh": node.fresh,
    }


def _count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**31


def _shape(m: Any, where: str) -> dict[str, Any]:
    if isinstance(m, dict) and "fresh" not in m:  # a journal written before branches kept it
        m = {**m, "fresh": False}
    if not isinstance(m, dict) or set(m) != set(META):
        raise ValueError(f"{where}: its tree record 'n' is not a node's place ({', '.join(META)})")
    ok = (
        isinstance(m["node"], str)
        and _PATH.fullmatch(m["node"]) is not None
        and (m["parent"] is None or isinstance(m["parent"], str))
        and m["kind"] in ("root", "child", "branch")
        and all(_count(m[k]) for k in ("offset", "depth", "shared", "ordinal", "k"))
        and isinstance(m["policy"], str)
        and isinstance(m["route"], str)
        and isinstance(m["forks"], dict)
        and all(isinstance(s, str) and _count(c) for s, c in m["forks"].items())
        and (m["origin"] is None or isinstance(m["origin"], str))
        and isinstance(m["forked"], bool)
        and isinstance(m["fresh"], bool)
        and (m["kind"] == "branch" or not m["fresh"])
    )
    if not ok:
        raise ValueError(f"{where}: its tree record 'n' holds a value of the wrong kind")
    return m


def _key(path: str) -> tuple[int, ...]:
    return tuple(int(p) for p in path.split("."))


class Agents:
    """The compiled agents of a tree's nodes: a child machine's compiled once per (parent agent, name)."""

    def __init__(self) -> None:
        self._made: dict[tuple[int, str], Any] = {}

    def child(self, parent: Any, name: str) -> Any:
        key = (id(parent), name)
        if key not in self._made:
            self._made[key] = parent.child_agent(name)
        return self._made[key]


def tree_form(
    path: Any,
    trajs: dict[str, Trajectory],
    metas: dict[str, Any],
    done: set[str],
    groups: list[dict[str, Any]],
    agent: Any,
    vocab: int | None,
) -> dict[str, tuple[dict[str, Any] | None, list[dict[str, Any]]]]:
    """Every root's tree record and its nodes in the form Stream.restore takes (`{"done", "n", **trajectory}`, in
    path order), each node checked against its tree and its own agent (states, limits, the vocabulary) as a
    root is; ValueError of one line naming the journal otherwise."""
    roots = {sid: g for g in groups for sid in g["members"]}
    _check_roots(path, metas, roots, agent)
    nodes = [s for s in trajs if s not in roots]
    for sid in nodes:
        if sid not in metas:
            raise ValueError(f"{path}: trajectory {sid!r} is in no group and is no tree node")
        _shape(metas[sid], f"{path}: node {sid!r}")
    nodes.sort(key=lambda s: (len(metas[s]["node"]), _key(metas[s]["node"])))
    agents, agent_of = Agents(), {sid: agent for sid in roots}
    root_of = {sid: sid for sid in roots if sid in trajs}  # session id -> its tree's root
    made: dict[str, list[int]] = {}  # session id -> the creation numbers of its nodes
    out: dict[str, tuple[dict[str, Any] | None, list[dict[str, Any]]]] = {
        sid: (metas.get(sid), []) for sid in roots
    }
    by_agent: dict[int, tuple[Any, dict[str, Any], list[dict[str, Any]]]] = {}
    for sid in nodes:
        m, traj = metas[sid], trajs[sid]
        where = f"{path}: node {sid!r}"
        parent_sid, _, at = sid.rpartition(":")  # a node's id is its parent's, ":", its path
        parent_path, _, number = m["node"].rpartition(".")
        tree = root_of.get(parent_sid)
        parent_at = metas[parent_sid]["node"] if parent_sid in metas else "0"
        if (
            at != m["node"]
            or tree is None
            or m["parent"] != parent_path
            or parent_at != parent_path
            or m["depth"] != m["node"].count(".")
        ):
            raise ValueError(f"{where}: its path, parent or depth does not fit a tree of this run")
        root = trajs[tree]
        root_of[sid] = tree
        if (traj.index, traj.sample, traj.uid) != (root.index, root.sample, root.uid):
            raise ValueError(f"{where}: not of its root's row and sample")
        limits = agent.spec.tree
        if (
            (limits.max_depth is not None and m["depth"] > limits.max_depth)
            or int(number) >= limits.max_children
            or m["ordinal"] >= limits.max_nodes
        ):
            raise ValueError(f"{where}: past its tree's bounds (tree: in the spec)")
        parent = (agent_of[parent_sid], metas.get(parent_sid))
        node_agent = _node_agent(where, sid, m, traj, parent, agents, agent.spec.policy, tree)
        if parent_sid in done and sid not in done:
            raise ValueError(f"{where}: unfinished under a finished parent")
        agent_of[sid] = node_agent
        made.setdefault(parent_sid, []).append(int(number))
        entry = {"done": sid in done, "n": m, **decoded(traj)}
        out[tree][1].append(entry)
        by_agent.setdefault(id(node_agent), (node_agent, roots[tree], []))[2].append(entry)
    _check_numbering(path, made, agent_of, metas)
    for node_agent, group, entries in by_agent.values():  # what a root is checked for, with the node's agent
        _check({"groups": [_group(group, entries)]}, node_agent, vocab)
    return out


def starts_over(traj: Trajectory) -> bool:
    """An unfinished trajectory that cannot go on from its last boundary: inside its interaction (a user
    simulator's session is not resumed), or failed with its end not journaled (a kill between the two)."""
    return traj.interaction_started or traj.failure is not None


def restart_failed(
    nodes: list[dict[str, Any]], first: dict[str, dict[str, Any]]
) -> tuple[list[dict[str, Any]], int]:
    """A tree's nodes (`tree_form`'s entries), each unfinished one whose failure was journaled but not its end put
    back at its first record (`first`: the fold's), as a failed row is (fsm/run/resume.py): its parent's action,
    run again, takes it back and it runs from its start. Only one that made no node and took or was refused no
    fork since, whose place in the tree is still as it was made; another has its tree start over
    (`starts_over`). The entries, and how many were put back."""
    out, again = [], 0
    for e in nodes:
        m, traj = e["n"], decode_trajectory(e)
        if e["done"] or traj.failure is None or m["k"] or m["forked"] or "fork_refused" in traj.extra:
            out.append(e)
            continue
        again += 1
        fresh = m["kind"] == "branch"  # a branch's first record is its copy at the entry it forked at
        out.append({"done": False, "n": {**m, "fresh": fresh}, **decoded(from_whole(first[traj.session_id]))})
    return out, again


def _check_roots(path: Any, metas: dict[str, Any], roots: dict[str, Any], agent: Any) -> None:
    """Each root's tree record is a root's: node "0", no parent, origin or offset, its own route and policy."""
    for sid, m in metas.items():
        if sid in roots:
            _shape(m, f"{path}: trajectory {sid!r}")
            place = (m["node"], m["parent"], m["kind"], m["depth"], m["offset"], m["shared"], m["ordinal"])
            ok = place == ("0", None, "root", 0, 0, 0, 0)
            if not ok or m["route"] != sid or m["origin"] is not None or m["policy"] != agent.spec.policy:
                raise ValueError(f"{path}: trajectory {sid!r}: its tree record is not its tree's root")


def _node_agent(
    where: str,
    sid: str,
    m: dict[str, Any],
    traj: Trajectory,
    parent: tuple[Any, dict[str, Any] | None],
    agents: Agents,
    root_policy: str,
    tree: str,
) -> Any:
    """The agent a node runs: a child machine of its parent's spec, or (a branch) its parent's own; its
    policy, routing key and shared prefix checked against that origin."""
    parent_agent, parent_meta = parent
    if m["kind"] == "child":
        child = parent_agent.spec.children.get(m["origin"]) if m["origin"] is not None else None
        if child is None:
            raise ValueError(f"{where}: {m['origin']!r} is not a child machine of its parent's spec")
        node_agent = agents.child(parent_agent, m["origin"])
        if m["policy"] != (child.policy or node_agent.spec.policy) or m["route"] != sid or m["shared"]:
            raise ValueError(f"{where}: its policy, routing key or shared prefix is not its child machine's")
        return node_agent
    if m["kind"] == "branch":
        parent_policy = parent_meta["policy"] if parent_meta else root_policy
        parent_route = parent_meta["route"] if parent_meta else tree
        if m["origin"] not in parent_agent.forks:
            raise ValueError(f"{where}: {m['origin']!r} is not a forking state of its parent's spec")
        if m["policy"] != parent_policy or m["route"] != parent_route or m["shared"] != m["offset"]:
            raise ValueError(f"{where}: its policy, routing key or shared prefix is not its parent's")
        if m["offset"] > len(traj.prompt_ids) + len(traj.response_ids):
            raise ValueError(f"{where}: it branched off past its own tokens")
        return parent_agent
    raise ValueError(f"{where}: a node of kind 'root' under another")


def _check_numbering(
    path: Any, made: dict[str, list[int]], agent_of: dict[str, Any], metas: dict[str, Any]
) -> None:
    """Each parent's nodes are numbered 0, 1, ... and as many as it says it made."""
    for sid, numbers in made.items():
        if sorted(numbers) != list(range(len(numbers))):
            raise ValueError(f"{path}: trajectory {sid!r}: its nodes are not numbered 0, 1, ... in order")
    for sid in agent_of:
        m = metas.get(sid)
        if m is not None and m["k"] > len(made.get(sid, ())):
            raise ValueError(f"{path}: trajectory {sid!r}: made {m['k']} nodes, but the journal holds fewer")


def _group(g: dict[str, Any], entries: list[dict[str, Any]]) -> dict[str, Any]:
    trajs = [{k: v for k, v in e.items() if k != "n"} for e in entries]
    return {
        "status": "running",
        "uid": g["uid"],
        "reruns": 0,
        "version_min": 0,
        "version_max": 0,
        "sampling": g["sampling"],
        "trajectories": trajs,
    }


def restore_tree(
    root: Trajectory,
    meta: dict[str, Any] | None,
    entries: Iterable[tuple[Trajectory, dict[str, Any], bool]],
    agent: Any,
    child_agent: Callable[[Any, str], Any],
    finished: bool,
) -> int:
    """Put `root`'s tree back from its journaled nodes (`tree_form`'s, decoded: (trajectory, its `n`, finished)),
    each node as its last boundary left it: under its parent when the parent had made it by then, else pending,
    for the parent's action to take back. A finished root's rows get its reward where they have none, as when
    it finished (fsm/run/tree.py `end`: that came after their own last records). The nodes pending."""
    entries = sorted(entries, key=lambda e: (len(e[1]["node"]), _key(e[1]["node"])))
    if meta is None and not entries:
        return 0
    node = root_node(root, agent)
    if meta is not None:
        node.forks, node.forked = dict(meta["forks"]), meta["forked"]
    made = {"0": meta["k"] if meta is not None else 0}
    by_path: dict[str, Trajectory] = {"0": root}
    pending = 0
    count = TreeCount()
    node.count = count
    for traj, m, done in entries:
        parent: Node = by_path[m["parent"]].node
        kind = m["kind"]
        traj.node = Node(
            node.tree,
            m["node"],
            m["parent"],
            kind,
            m["offset"],
            m["policy"],
            m["depth"],
            origin=m["origin"],
            shared_length=m["shared"],
            route=m["route"],
            agent=child_agent(parent.agent, m["origin"]) if kind == "child" else parent.agent,
            count=count,
            ordinal=m["ordinal"],
            forks=dict(m["forks"]),
            forked=m["forked"],
            root_agent=agent,
            finished=done,
            fresh=m.get("fresh", False),
        )
        by_path[m["node"]], made[m["node"]] = traj, m["k"]
        if int(m["node"].rsplit(".", 1)[1]) < made[m["parent"]]:
            parent.nodes.append(traj)
        else:
            if parent.pending is None:
                parent.pending = {}
            parent.pending[m["node"]] = traj
            pending += 1
    count.nodes = 1 + len(entries) - pending  # each pending one counts again when it is taken back
    if finished and root.reward_score is not None:
        for sub in row_nodes(root):
            if sub.reward_score is None:
                sub.reward_score = root.reward_score
    return pending


def tree_nodes(root: Trajectory) -> list[Trajectory]:
    """Every node of `root`'s tree but the root, under their parents or pending, parents first."""
    out: list[Trajectory] = []
    todo = [root]
    while todo:
        node = todo.pop(0).node
        subs = [*node.nodes, *(node.pending or {}).values()]
        out += subs
        todo += subs
    return out
