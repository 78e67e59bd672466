"""`agentfsm replay OUT --row N` and `agentfsm show` of a run that is running or died: a run's trajectories rebuilt
from its journal (fsm/run/journal.py) with no server and no model, only the spec and the tokenizer the journal
names. Replay prints each sample's transcript, its path through the diagram, the token check (the tokens
against a fresh render of the messages) and its reward recomputed with the spec's reward function as it is now,
beside the recorded one."""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from fsm.cli.args import CLIError
from fsm.cli.resume import journal_spec
from fsm.run.fold import Rebuilt, rebuild
from fsm.run.journal import JOURNAL, JournalError, Scan
from fsm.run.signals import warn
from fsm.run.trajectory import Trajectory


def _load(out: Path, spec: str | None, tokenizer: str | None) -> tuple[Rebuilt, Any, Any]:
    """The journal replayed, the agent (the spec it names, or `spec`) and its codec (the tokenizer it names)."""
    from fsm.api import load_tokenizer
    from fsm.run.codec import other_tokenizer
    from fsm.run.compile import compile_spec
    from fsm.run.runtime import agent_codec

    try:
        read = Scan(out / JOURNAL)  # streamed, each record bounded (fsm/run/journal.py)
        rebuilt = rebuild(read)
    except JournalError as exc:
        raise CLIError(str(exc)) from None
    if read.torn:
        warn(read.torn)
    ident = rebuilt.identity
    spec = spec or journal_spec(out / JOURNAL, ident.get("spec"), "pass --spec")
    agent = compile_spec(spec)
    if agent.hash != ident.get("spec_hash"):
        warn(f"{spec} changed since the run (spec hash {ident.get('spec_hash')}, now {agent.hash})")
    named = (ident.get("tokenizer") or {}).get("name")
    if not tokenizer and not named:
        raise CLIError(f"{out / JOURNAL} names no tokenizer; pass --tokenizer")
    try:
        tok = load_tokenizer(tokenizer) if tokenizer else _local_tokenizer(str(named))
    except (OSError, ValueError) as exc:
        if not tokenizer:  # the journal's: looked for on this machine only
            raise CLIError(
                f"{out / JOURNAL} names the tokenizer {named!r}, which is not on this machine (reading a run makes "
                f"no request); pass --tokenizer {named} to download it, or --tokenizer DIR"
            ) from None
        raise CLIError(f"--tokenizer {tokenizer}: cannot load it ({exc})") from None
    tokenizer = tokenizer or named
    codec = agent_codec(agent, tok)
    if other_tokenizer(ident.get("tokenizer"), codec) is not None:
        warn(f"the tokenizer {tokenizer} is not the one the run used ({named}): the token check may differ")
    _trees(out, rebuilt, agent)
    return rebuilt, agent, codec


def _local_tokenizer(name: str) -> Any:
    """The tokenizer a journal names, from this machine only (a directory, or the Hugging Face cache): reading
    a run makes no request, whatever HF_HUB_OFFLINE says. `local_files_only` alone is not enough: the hub client
    still fetches a registry for its user agent unless it is offline, so it is, for this load."""
    from huggingface_hub import constants
    from transformers import AutoTokenizer

    was, constants.HF_HUB_OFFLINE = constants.HF_HUB_OFFLINE, True
    try:
        return AutoTokenizer.from_pretrained(name, local_files_only=True)
    finally:
        constants.HF_HUB_OFFLINE = was


def _trees(out: Path, rebuilt: Rebuilt, agent: Any) -> None:
    """Each tree's nodes put back in place as a resume would (fsm/run/treejournal.py `restore_tree`): a child
    knows its own spec, a forked root its branches, so each is checked and scored as the run did it."""
    from fsm.run.treejournal import Agents, restore_tree

    by_root: dict[str, list[tuple[Trajectory, dict[str, Any], bool]]] = {}
    for sid, m in rebuilt.nodes.items():
        root, _, path = sid.partition(":")
        if path and sid in rebuilt.trajs:
            by_root.setdefault(root, []).append((rebuilt.trajs[sid], m, sid in rebuilt.done))
    agents = Agents()
    for root, entries in by_root.items():
        if root not in rebuilt.trajs:
            raise CLIError(f"{out / JOURNAL}: tree nodes of {root!r}, a trajectory it does not hold")
        try:
            restore_tree(
                rebuilt.trajs[root],
                rebuilt.nodes.get(root),
                entries,
                agent,
                agents.child,
                root in rebuilt.done,
            )
        except (KeyError, ValueError, TypeError) as exc:
            raise CLIError(f"{out / JOURNAL}: the tree of {root!r} does not fit together ({exc!r})") from None


def _order(traj: Trajectory) -> tuple[int, int, tuple[int, ...]]:
    """Rows in the run's order: by row and sample, each tree in preorder (the root first)."""
    path = traj.node.node
    return traj.index, traj.sample, tuple(int(p) for p in path.split("."))


def _recompute(rebuilt: Rebuilt, agent: Any, codec: Any, traj: Trajectory) -> float | None:
    """The reward of `traj` by the spec's reward function as it is now, as the run gives it (Runner._finish): a
    forked node's is its branches' mean, a child's its tree's (the root's), any other row's its own."""
    node = traj.node
    if node.forked:
        scores = [s for b in node.nodes if (s := _recompute(rebuilt, agent, codec, b)) is not None]
        return sum(scores) / len(scores) if scores else None
    if node.kind == "child":
        return _recompute(rebuilt, agent, codec, rebuilt.trajs[node.tree])
    return _rescore(node.agent or agent, codec, traj)


def _rescore(agent: Any, codec: Any, traj: Trajectory) -> float | None:
    """The reward of `traj` by `agent`'s reward function as it is now (its recorded reward is left alone)."""
    from fsm.run.runtime import Runner

    if agent.reward is None:
        return None
    runner = Runner(agent, None, codec, watchdog_s=None)  # type: ignore[arg-type]  # no backend: never called
    recorded = traj.reward_score
    try:
        scoring = SimpleNamespace(agent=agent, codec=codec)  # all `_score` reads of a run's context
        asyncio.run(runner._score(scoring, traj))  # type: ignore[arg-type]
        return traj.reward_score
    finally:
        traj.reward_score = recorded


def cmd_replay(args: argparse.Namespace) -> int:
    from fsm.run.policy import check_segments
    from fsm.run.runtime import RewardError, agent_codec

    out = Path(args.run_dir)
    rebuilt, agent, codec = _load(out, args.spec, args.tokenizer)
    chosen = [
        (sid, t)
        for sid, t in rebuilt.trajs.items()
        if t.index == args.row and (args.sample is None or t.sample == args.sample)
    ]
    if not chosen:
        rows = sorted({t.index for t in rebuilt.trajs.values()})
        have = f"its rows are {rows[0]}..{rows[-1]}" if rows else "it has no trajectories"
        raise CLIError(f"{out / JOURNAL}: no row {args.row} in this run ({have})")
    print_resumes(rebuilt)
    for sid, traj in sorted(chosen, key=lambda st: _order(st[1])):
        done = sid in rebuilt.done
        node, where = traj.node, ""
        if not node.alone:  # its place in its tree, its own spec
            origin = f" {node.origin}" if node.kind == "child" else ""
            where = f" node {node.node} ({node.kind}{origin}, policy {node.policy})"
        print(
            f"== row {traj.index} sample {traj.sample}{where} ({sid}): {'finished' if done else 'in flight'}, "
            f"{traj.termination_reason or 'in ' + traj.state}"
        )
        own = node.agent or agent
        for m in traj.messages:
            content = m.get("content")
            text = content if isinstance(content, str) else json.dumps(content, ensure_ascii=False)
            calls = m.get("tool_calls")
            print(
                f"[{m.get('role')}] {text}" + (f" {json.dumps(calls, ensure_ascii=False)}" if calls else "")
            )
        print("path: " + " -> ".join(traj.path))
        print(
            f"tokens: {len(traj.prompt_ids)} prompt, {len(traj.response_ids)} response "
            f"({sum(traj.response_mask)} the model's), {len(traj.closed) + 1} segment(s)"
        )
        if traj.failed or not traj.prompt_ids:
            print("token check: none (no tokens to check)")
        else:
            own_codec = codec if own is agent else agent_codec(own, codec.tokenizer)
            differ = check_segments(own_codec, traj, own.spec.context.policy == "template")
            print(f"token check: {'exact' if differ is None else differ}")
        if agent.reward is not None and (done or traj.prompt_ids or node.forked):
            was = traj.reward_score
            try:
                now = _recompute(rebuilt, agent, codec, traj)
            except RewardError as exc:
                print(f"reward: recorded {was}, not recomputed: {exc}")
                continue
            diff = "" if was is None or now is None else f" (difference {now - was:+g})"
            print(f"reward: recorded {was}, recomputed {now}{diff}")
    return 0


def print_resumes(rebuilt: Rebuilt) -> None:
    """Each resume that accepted changes in what made the rows (fsm/run/resume.py), and how many
    trajectories had finished before it: rows finished later were made after the change."""
    for k, r in enumerate(rebuilt.resumes, start=1):
        if r["accepted"]:
            print(
                f"resume {k} (after {r['finished_before']} trajectories finished) accepted changes: "
                + "; ".join(map(str, r["accepted"]))
            )


def show_journal(out: Path, spec: str | None = None) -> Path:
    """A trajectories.jsonl of the journal's trajectories (finished or not), in a temporary file, for `show`."""
    from fsm.output.rundir import json_text, trajectory_record

    rebuilt, _, codec = _load(out, spec, None)
    running = len(rebuilt.trajs) - len(rebuilt.done)
    ended = rebuilt.ended or "not ended (running, or died: `agentfsm run --resume` goes on)"
    print(
        f"{out / JOURNAL}: {len(rebuilt.done)} trajectories finished, {running} in flight; the run: {ended}"
    )
    print_resumes(rebuilt)
    f = tempfile.NamedTemporaryFile("w", suffix=".jsonl", prefix="agentfsm-journal-", delete=False)
    with f:
        for t in sorted(rebuilt.trajs.values(), key=_order):
            if t.termination_reason is None:
                t.termination_reason = f"in flight: {t.state}"
            f.write(json_text(trajectory_record(t, codec), ensure_ascii=False) + "\n")
    return Path(f.name)
