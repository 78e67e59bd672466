"""A node of a tree: where a trajectory's rows sit and the nodes it made (docs/trees.md).

Every trajectory has one: a linear row is a tree of one node, its root, so nothing that reads a place in a tree
asks whether there is one. Below the trajectory (fsm/run/trajectory.py holds it), the engine's trees
(fsm/run/tree.py: child machines and forks) and the gateway's session trees (fsm/gateway/tree.py) use it alike.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class TreeCount:
    """What one tree shares: its node count, against the root spec's `tree.max_nodes`."""

    nodes: int = 1
    run: int = 0  # of them, charged to the run's `tree.max_run_nodes` (released when the root ends)


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
    agent: Any = None  # the CompiledAgent this node runs (a root's: bound once its tree grows)
    count: TreeCount = field(default_factory=TreeCount)
    ordinal: int = 0  # the node's number in its tree, creation order (distinct sampling seeds)
    forks: dict[str, int] = field(default_factory=dict)  # state -> forks there along this path
    forked: bool = False  # it split into branches: its tokens live on in theirs, it has no row of its own
    root_agent: Any = None  # the root's CompiledAgent: its `tree:` bounds the whole tree
    # a resumed tree (fsm/run/treejournal.py): nodes the journal holds that were made after this node's last
    # state boundary, by path, for its re-run action to take back instead of making them again; and whether
    # this node had finished (taken back as it is, never run again)
    pending: dict[str, Any] | None = None  # path -> its Trajectory
    finished: bool = False
    # a branch at the entry it was copied at: it runs that state's action, it does not fork there again (each copy
    # would fork anew, 2 + 4 + 8 ... nodes where `branches: 2` was declared); journaled, so a resume knows it too
    fresh: bool = False

    def fields(self, shared: int = 0) -> dict[str, Any]:
        """Its rows' place in the tree (docs/trees.md, Rows, but `weight`), for a row whose first `shared` tokens are
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

    @property
    def alone(self) -> bool:
        """A linear row's tree: a root that has made no node and met no fork (the journal keeps no place for it)."""
        return (
            self.kind == "root" and not self.nodes and not self.forks and not self.forked and not self.pending
        )
