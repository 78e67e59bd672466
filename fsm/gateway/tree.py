"""A gateway session as a tree of nodes: sub-agents (child sessions) and branches (a request that continues an
earlier turn), each node a sequence of segments of the row's one trajectory, each segment one training row.

A harness reaches a child session at `/sessions/{id}/child/{name}/v1/...` (`HarnessCall.child(name)`); the
names from the root to a session are its *line*. Which node of its line a request is recorded on (extend,
branch, history, child): docs/gateway.md, "Trees: sub-agents and retries".

The trajectory holds one node's open segment in its live fields at a time (fsm/run/trajectory.py); the others
are parked here. `finalize` puts every segment back in the order they began (the session's last one last, where
a reward placed "last" goes) with each row's tree fields in `traj.extra["tree"]` and its tools in
`traj.extra["segment_tools"]` (`--check-tokens` renders each row with its own).
"""

from __future__ import annotations

import os
import re
from array import array
from dataclasses import dataclass, field
from typing import Any

from fsm.gateway.record import (
    AUX,
    Call,
    GatewayError,
    Plan,
    Recorder,
    ends_on_observation,
    message_key,
    too_many_segments,
)
from fsm.run.trajectory import Node, Segment, TokenRuns, Trajectory

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")
POLICY = "default"  # the gateway serves one policy
NODE_KINDS = ("root", "child", "branch")  # any other node kind is an auxiliary call's ("title", "compaction")


def child_line(tail: str) -> tuple[tuple[str, ...], str]:
    """(the child names, the rest) of a path under a session: `child/a/child/b/v1/...` -> (("a", "b"), "v1/...")."""
    names: list[str] = []
    while tail.startswith("child/"):
        name, _, tail = tail[6:].partition("/")
        if not NAME.fullmatch(name):
            raise GatewayError(
                f"child name {name[:64]!r}: a child session is named by 1-64 letters, digits, '_' or '-'",
                code="invalid_child",
            )
        names.append(name)
    return tuple(names), tail


def line_path(line: tuple[str, ...]) -> str:
    return "".join(f"/child/{name}" for name in line) or "the session"


@dataclass(eq=False, slots=True, kw_only=True)
class SessionNode(Node):
    """A node of a session's tree (fsm/run/tree.py Node: its place, `node` given when it is recorded, its
    children in `nodes`) and how it is recorded: its line and the conversation of its segments."""

    line: tuple[str, ...]  # the child names from the root session to it (a branch keeps its parent's)
    up: SessionNode | None  # its parent node
    parent_seq: int | None  # the parent's segment it starts in, `branch_offset` tokens into its row
    recorder: Recorder
    seq: int = -1  # its open segment (the one a request extends)
    seqs: list[int] = field(default_factory=list)  # its segments, in order
    # a sub-agent found by its content (`Tree.plan`): the ids of the calls its parent had made when it began
    calls: tuple[str, ...] | None = None


class Tree:
    """The nodes of one session and the segments parked while another node's is live in the trajectory."""

    def __init__(
        self, max_segments: int = 32, max_nodes: int = 64, max_depth: int = 4, auxiliary: str = "separate"
    ) -> None:
        self.max_segments, self.max_nodes, self.max_depth = max_segments, max_nodes, max_depth
        self.auxiliary = auxiliary  # GatewayLimits.auxiliary_calls: keep, separate or drop their rows
        self.root = SessionNode("", line=(), up=None, parent_seq=None, recorder=Recorder(max_segments))
        self.nodes: list[SessionNode] = [self.root]
        # the latest node each line recorded on
        self.recent: dict[tuple[str, ...], SessionNode] = {(): self.root}
        self.known: set[tuple[str, ...]] = {()}  # lines a request has named (their children may come)
        self.stored: list[Segment | None] = []  # by segment number; None: the live one
        self.owner: list[SessionNode] = []
        self.tails: list[bool] = []  # needs_tail of each parked segment
        self.tools: list[list[dict[str, Any]] | None] = []
        self.live = -1
        self.finalized = False

    # --- which node a request is recorded on ------------------------------------------------------------

    def check_line(self, line: tuple[str, ...]) -> None:
        """A child request's line, checked when it arrives (an API error names what is wrong)."""
        if not line:
            return
        path = line_path(line)
        if len(line) > self.max_depth:
            raise GatewayError(
                f"{path}: a child session {len(line)} deep, past the gateway's max_depth ({self.max_depth})",
                code="tree_too_deep",
            )
        if len(set(line)) < len(line):
            raise GatewayError(
                f"{path}: a cycle, a child session named again under itself", code="tree_cycle"
            )
        if line[:-1] not in self.known:
            raise GatewayError(
                f"{path}: unknown parent session {line_path(line[:-1])} (a child session exists once it has "
                "made a call)",
                code="unknown_parent",
                status=404,
            )
        self.known.add(line)

    def plan(self, traj: Trajectory, call: Call) -> tuple[SessionNode, Plan]:
        """The node `call` is recorded on (a new one is not in the tree until `begin`) and how."""
        line = call.child
        nodes = [n for n in self.nodes if n.line == line and n.seqs]
        if not nodes:  # the line's first call: the session's own, or a new child's
            ends_on_observation(call.messages)
            first = Plan("first", call.messages, [message_key(m) for m in call.messages])
            return (self._new_child(traj, line) if line else self.root), first
        recent = self.recent[line]
        keys: list[tuple] = []
        for node in [recent, *(n for n in reversed(nodes) if n is not recent)]:
            plan, keys = node.recorder.extends(call)
            if plan is not None:
                return node, plan
        if len(self.stored) >= self.max_segments:
            raise too_many_segments(len(self.stored), self.max_segments)
        best: tuple[SessionNode, tuple[int, int, int, int]] | None = None
        for node in nodes:
            mark = node.recorder.branch_mark(call, keys)
            if mark is not None and (best is None or mark[1] > best[1][1]):
                best = node, mark
        if best is not None:
            parent, mark = best
            self._room(parent)
            branch = self._node("branch", line, parent, mark[3], mark[0])
            return branch, Plan("branch", call.messages[mark[1] :], keys, mark)
        if not line:
            caller = self._caller(recent, nodes)
            if caller is None:
                return recent, Plan("history", call.messages, keys)
            # a new conversation once the agent has made calls: a sub-agent's, if its answer comes back to the
            # agent for one of them (`_link`); else, at the end, a new history of the agent
            child = self._child(traj, caller[0], line)
            child.calls = caller[1]
            return child, Plan("first", call.messages, keys)
        return self._new_child(traj, line), Plan("first", call.messages, keys)

    def _caller(
        self, recent: SessionNode, nodes: list[SessionNode]
    ) -> tuple[SessionNode, tuple[str, ...]] | None:
        """The latest node of the session's own line whose conversation holds model turns with calls, and their
        ids (not a sub-agent found by its content: its own sub-agents are not told apart from it)."""
        for node in [recent, *reversed(nodes)]:
            ids = tuple(
                c["id"]
                for m in node.recorder.sent
                if m["role"] == "assistant"
                for c in m.get("tool_calls") or ()
            )
            if node.calls is None and ids:
                return node, ids
        return None

    def _new_child(self, traj: Trajectory, line: tuple[str, ...]) -> SessionNode:
        parent = self.recent.get(line[:-1])
        if line[-1].startswith(AUX) and parent is not None:
            # a call that is not the agent's own turn (a title, a compaction): a node of its own under the
            # line's latest, even before that one's first call (a harness asks for a title beside its first)
            self._room(parent)
            seq = parent.seq if parent.seqs else None
            return self._node(line[-1][len(AUX) :], line, parent, self._context(traj, seq), seq)
        if parent is None or not parent.seqs:
            raise GatewayError(
                f"{line_path(line)}: unknown parent session {line_path(line[:-1])} (it has recorded no call)",
                code="unknown_parent",
                status=404,
            )
        if len(self.stored) >= self.max_segments:
            raise too_many_segments(len(self.stored), self.max_segments)
        return self._child(traj, parent, line)

    def _child(self, traj: Trajectory, parent: SessionNode, line: tuple[str, ...]) -> SessionNode:
        """A child node of `parent`'s latest turn: it begins where the parent's row is now."""
        self._room(parent)
        return self._node("child", line, parent, self._context(traj, parent.seq), parent.seq)

    def _context(self, traj: Trajectory, seq: int | None) -> int:
        """The length of segment `seq`'s context now (0 for none): where a node begun from it starts."""
        if seq is None:
            return 0
        seg = self.segment(traj, seq)
        return len(seg.prompt_ids) + len(seg.response_ids)

    def _node(
        self, kind: str, line: tuple[str, ...], up: SessionNode, offset: int, parent_seq: int | None
    ) -> SessionNode:
        """A new node under `up`, numbered when it is recorded (`_register`); an auxiliary call's policy is its
        kind when its rows are trained apart."""
        policy = kind if kind not in NODE_KINDS and self.auxiliary == "separate" else POLICY
        return SessionNode(
            "",
            "",
            up.node,
            kind,
            offset,
            policy,
            up.depth + 1,
            line=line,
            up=up,
            parent_seq=parent_seq,
            recorder=Recorder(self.max_segments),
        )

    def _room(self, parent: SessionNode) -> None:
        if len(self.nodes) >= self.max_nodes:
            raise GatewayError(
                f"the session's tree holds {len(self.nodes)} nodes, its max_nodes ({self.max_nodes})",
                code="too_many_nodes",
            )
        if parent.depth + 1 > self.max_depth:
            raise GatewayError(
                f"a node under {parent.node} would be {parent.depth + 1} deep, past the gateway's max_depth "
                f"({self.max_depth})",
                code="tree_too_deep",
            )

    # --- the trajectory's live segment --------------------------------------------------------------------

    def segment(self, traj: Trajectory, seq: int) -> Segment:
        """Segment `seq`, live or parked."""
        stored = self.stored[seq]
        return traj.current_segment() if stored is None else stored

    def switch(self, traj: Trajectory, node: SessionNode) -> None:
        """Put `node`'s open segment in the trajectory's live fields (the live one is parked as it is)."""
        if node.seq != self.live:
            self._park(traj)
            self._load(traj, node.seq)
        self.recent[node.line] = node

    def begin(
        self,
        traj: Trajectory,
        node: SessionNode,
        ids: list[int],
        reason: str,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
    ) -> int:
        """A new segment of `node` (registered in the tree if new) with prompt `ids`, the render of `messages`;
        its number. The live one is parked; a history rewrite of the live node closes it as the trajectory's
        rewrites do (fsm/run/trajectory.py `start_segment`: observations after its last turn are cut)."""
        if self.live >= 0 and node.seqs and node.seq == self.live:
            traj.start_segment(ids, reason, messages)
            self.stored[self.live] = traj.closed.pop()  # type: ignore[union-attr]
        else:
            if self.live >= 0:
                self._park(traj)
            traj.messages = messages
            traj.response_ids, traj.response_mask = array("i"), array("b")
            traj.set_prompt(ids)
            traj.response_logprobs, traj._version_runs, traj.runs = array("f"), array("i"), TokenRuns()
            traj.turn_rewards, traj.needs_tail = [], False
            traj.segment_start = (reason, len(messages), traj.assistant_turns, len(traj.path) - 1)
        traj.tool_schemas = tools
        return self.register(node, tools)

    def register(self, node: SessionNode, tools: list[dict[str, Any]] | None) -> int:
        """Segment number of `node`'s new segment, now live (the session's first: the trajectory's own)."""
        if not node.node:
            assert node.up is not None
            node.node = f"{node.up.node}.{len(node.up.nodes)}"
            node.up.nodes.append(node)
            self.nodes.append(node)
        seq = self.live = len(self.stored)
        self.stored.append(None)
        self.owner.append(node)
        self.tails.append(False)
        self.tools.append(tools)
        node.seq = seq
        node.seqs.append(seq)
        self.recent[node.line] = node
        return seq

    def _park(self, traj: Trajectory) -> None:
        seq = self.live
        self.stored[seq] = traj.current_segment()
        self.tails[seq], self.tools[seq] = traj.needs_tail, traj.tool_schemas

    def _load(self, traj: Trajectory, seq: int) -> None:
        seg = self.stored[seq]
        assert seg is not None
        traj.prompt_ids, traj.response_ids = seg.prompt_ids, seg.response_ids
        traj.response_mask, traj.response_logprobs = seg.response_mask, seg.response_logprobs
        traj._version_runs, traj.runs = seg.version_runs, seg.runs
        traj.messages, traj.turn_rewards = seg.messages, seg.turn_rewards
        traj.needs_tail, traj.tool_schemas = self.tails[seq], self.tools[seq]
        traj.segment_start = (seg.reason, seg.prompt_messages, traj.assistant_turns - seg.turns, seg.at)
        self.stored[seq], self.live = None, seq

    # --- the rows -------------------------------------------------------------------------------------------

    def finalize(self, traj: Trajectory) -> None:
        """Every segment back in the trajectory, in the order they began (the session's last one last), and the
        tree fields of each row. Once; nothing to do for a session that recorded no call."""
        if self.finalized or self.live < 0:
            return
        self.finalized = True
        self._park(traj)
        self._link()
        kept = [s for s in range(len(self.stored)) if not self._dropped(s)] or list(range(len(self.stored)))
        # (a session of dropped calls only keeps its rows)
        last = self.live if self.live in kept else kept[-1]
        order = [s for s in kept if s != last] + [last]
        segs = [self.stored[s] for s in order]
        for k, seg in enumerate(segs):
            seg.index = k  # type: ignore[union-attr]
        for node in self.nodes:
            node.tree = traj.session_id
        rows = [self._fields(s, len(order)) for s in order]
        traj.closed = segs[:-1] if len(segs) > 1 else ()  # type: ignore[assignment]
        self._load(traj, last)
        traj.extra["tree"] = rows
        traj.extra["segment_tools"] = [self.tools[s] for s in order]

    def _link(self) -> None:
        """Sub-agents found by their content (`calls`): one whose final answer (its last turn, without calls) is
        in the text the parent then got back for one of those calls (a tool result for it, or a user turn that
        names it: qwen-code's background agents report so) is that call's child. Any other was a new history of
        its parent after all (a compacted or edited conversation): its segments are the parent's, as such a
        request's always were, and the nodes are numbered again."""
        merged = False
        for node in [n for n in self.nodes if n.calls is not None]:
            up, last = node.up, node.recorder.sent[-1]
            assert up is not None and node.calls is not None
            answer = "" if last.get("tool_calls") else (last.get("content") or "").strip()
            back = (
                k[1]
                for keys, _ in up.recorder.segments.values()
                for k in keys
                if (k[0] == "tool" and k[2] in node.calls)
                or (k[0] == "user" and any(c and c in k[1] for c in node.calls))
            )
            if answer and any(answer in text for text in back):
                continue
            for seq in node.seqs:
                self.owner[seq] = up
                seg = self.stored[seq]
                if seg is not None and seg.reason == "child":
                    seg.reason = "history"
            up.seqs = sorted(up.seqs + node.seqs)
            up.nodes.remove(node)
            for below in node.nodes:  # (a branch of its conversation)
                below.up = up
                up.nodes.append(below)
            self.nodes.remove(node)
            merged = True
        if merged:
            for node in self.nodes[1:]:  # in the order they were made: a parent before its nodes
                assert node.up is not None
                n = node.up.nodes.index(node)
                node.node, node.parent, node.depth = f"{node.up.node}.{n}", node.up.node, node.up.depth + 1

    def _dropped(self, seq: int) -> bool:
        """Whether segment `seq` is an auxiliary call's that GatewayLimits.auxiliary_calls leaves out."""
        return self.auxiliary == "drop" and self.owner[seq].kind not in NODE_KINDS

    def _fields(self, seq: int, n_rows: int) -> dict[str, Any]:
        """One row's place in the tree (its node's fields, docs/gateway.md) and its weight; an auxiliary call's
        node_kind is its kind ("title", "compaction"), and its policy too when it is trained apart."""
        node = self.owner[seq]
        row = node.fields()
        shared = row.pop("shared_prefix")
        if node.up is not None and seq == node.seqs[0] and node.parent_seq is not None:
            mine, theirs = self.stored[seq], self.stored[node.parent_seq]
            assert mine is not None and theirs is not None  # parked: finalize parked the live one
            common = os.path.commonprefix([mine.context_ids(), theirs.context_ids()])
            shared = {"length": len(common), "node": node.parent}
        row["weight"] = 1.0 / n_rows  # per root: a root counts 1 in total, split over its rows
        row["shared_prefix"] = shared
        return row
