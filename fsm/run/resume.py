"""A run resumed from its journal (fsm/run/journal.py): the records replayed into the groups they describe, in
the form a snapshot has, and checked as strictly as one (fsm/run/snapcheck.py `_check`: states of this agent,
token ids in the vocabulary, finite logprobs <= 0, consistent lengths...), whatever the checksums say (they
are unkeyed: anyone can forge one).

What runs again: every unfinished trajectory goes on from its last state boundary, so the action it was in
when the run died (a model turn, a tool call, a rewrite) runs again; one whose interaction had started starts
over (a user simulator's state is not ours to write), as with a snapshot. Finished trajectories are never run
again: their groups come back ready. Trees resume node by node (fsm/run/treejournal.py): a finished node is
taken back as journaled, an unfinished one goes on from its last boundary; a tree with a node inside its
interaction starts over from its root.

What made the rows: the journal's `run` record holds `made_by` (fsm/run/provenance.py: the model's weights or
the servers' model, the code the spec names, the engine's options), and every resume appends a `resume` record
with what it runs on and the changes it accepted; a resume compares with the last of them. Weights: every model
token keeps the weight version that made it, in the journal as in the batch, and a resumed row keeps its tokens'
versions. A row goes on only with the weights it was generated with: when the servers now serve another version
than the unfinished rows' last tokens came from (an update between the kill and the resume), that is a change
too (`weights_change`). A change refuses the resume in one line, unless the caller accepts changes
(`--accept-changes`, `RunDir(out, accept_changes=True)`): then their next tokens carry the servers' version, as
after an update in the continuous mode, and the journal records what was accepted.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fsm.run.agent import CompiledAgent
from fsm.run.codec import FORMAT, decode_sampling, decode_trajectory, decoded, from_whole, tokenizer_id
from fsm.run.journal import JournalError, Read, Rebuilt, Scan, rebuild
from fsm.run.provenance import Change
from fsm.run.snapcheck import _check, check_identity, check_version_runs
from fsm.run.treejournal import tree_form


@dataclass
class Loaded:
    """A journal ready to be resumed: `data` in a snapshot's form (Stream.restore's input)."""

    data: dict[str, Any]
    good_bytes: int  # where the journal's writer goes on (a torn last record is cut off)
    torn: str | None  # one line: what a torn last record lost
    tool_results: dict[str, dict[str, Any]]
    finished: int  # trajectories finished before
    in_flight: int  # trajectories that go on from their last boundary: their current action runs again
    restarted: int  # trajectories that start over (inside their interaction)
    ended: str | None
    nodes_finished: int = 0  # tree nodes (child machines, branches) finished before: taken back as they are
    nodes_in_flight: int = 0  # tree nodes that go on from their last boundary
    last_versions: dict[str, int] = field(default_factory=dict)  # session -> the weight version of the last
    # model token of each trajectory that goes on (none for one without model tokens, or that starts over)
    # what made the rows (fsm/run/provenance.py): the last resume's, else the run's; None in an older journal
    made_by: dict[str, Any] | None = None
    accepted: list[str] = field(default_factory=list)  # the changes earlier resumes accepted, in order
    ident: dict[str, Any] = field(default_factory=dict)  # its `run` record
    top_id: int = -1  # the highest token id of its trajectories (`with_codec` bounds it by the vocabulary)


def weights_change(loaded: Loaded, now: int, served_by: str) -> Change | None:
    """None when the unfinished rows go on with the weights they were generated with (the newest version among
    their last tokens, as the continuous mode serves them); else the change, naming the servers and both
    versions (fsm/run/provenance.py `judge` refuses it, or records it accepted)."""
    if not loaded.last_versions:
        return None
    version = max(loaded.last_versions.values())
    if version == now:
        return None
    return Change(
        f"{len(loaded.last_versions)} unfinished trajectories were generated with weight version {version}, but "
        f"{served_by} now serves weight version {now}",
        f"update the servers back to version {version}",
        f"their next tokens carry version {now}",
    )


def served_by(backend: Any) -> str:
    """The servers (or the model) a backend reaches, for a message."""
    servers = getattr(backend, "servers", None)
    if servers:
        names = [
            str(getattr(s, "name", None) or getattr(getattr(s, "backend", None), "url", "?")) for s in servers
        ]
        return f"server{'s' * (len(names) > 1)} {', '.join(names)}"
    url = getattr(backend, "url", None)
    return f"server {url}" if url else f"the engine's model ({type(backend).__name__})"


def identity(agent: CompiledAgent, codec: Any, **more: Any) -> dict[str, Any]:
    """The journal's first record: what the run was (the spec, by hash; the tokenizer, by digest) and more."""
    tok = tokenizer_id(codec) if codec is not None else None
    if tok is not None and Path(tok["name"]).is_dir():  # a local one: found again from anywhere (replay)
        tok["name"] = str(Path(tok["name"]).resolve())
    return {
        "agent": agent.name,
        "spec_hash": agent.hash,
        "spec": str(Path(agent.path).resolve()) if agent.path else None,
        "tokenizer": tok,
        **more,
    }


def read_identity(path: str | Path) -> dict[str, Any]:
    """The journal's `run` record (for a resume that names no spec)."""
    first = next(iter(Scan(path)), None)  # the first record only: the rest is read by `load`
    if first is None or first.get("t") != "run" or first.get("format") not in (1, FORMAT):
        raise JournalError(f"{path}: not an agentfsm journal of format {FORMAT} (no 'run' record first)")
    return first


def load(path: str | Path, agent: CompiledAgent, codec: Any = None) -> Loaded:
    """The journal at `path`, checked against `agent` (spec hash), the tokenizer (`codec`'s digest) and its
    content; JournalError of one line otherwise."""
    read = Scan(path)  # streamed: the records are applied as they are read, never held together
    rebuilt = rebuild(read)
    ident = rebuilt.identity
    check_identity(path, ident, agent, codec, JournalError, _made(ident))
    # the ids a model may sample: its embedding rows (576 for the tiny model, 151,936 for Qwen2.5), the bound its
    # answers were checked against when they entered (fsm/families/codec.py `vocabulary_size`), not len(tokenizer)
    vocab = getattr(codec, "vocab_size", None) if codec is not None else None
    try:
        trees = tree_form(path, rebuilt.trajs, rebuilt.nodes, rebuilt.done, rebuilt.groups, agent, vocab)
    except JournalError:
        raise
    except Exception as exc:  # ValueError, SnapshotError and the malformed kinds: one line naming the journal
        msg = str(exc)
        raise JournalError(msg if msg.startswith(str(path)) else f"{path}: {msg}") from None
    try:
        data, counts, last = _snapshot_form(read, rebuilt, agent, trees)
        _check(data, agent, vocab)
    except JournalError:
        raise
    except Exception as exc:  # SnapshotError and the malformed kinds: one line naming the journal
        raise JournalError(f"{path}: {exc}") from None
    finished, in_flight, restarted, nodes_done, nodes_going = counts
    last_made = rebuilt.resumes[-1] if rebuilt.resumes else ident
    made_by = last_made.get("made_by")
    accepted = [a for r in rebuilt.resumes for a in r.get("accepted") or [] if isinstance(a, str)]
    return Loaded(
        data,
        read.good_bytes,
        read.torn,
        rebuilt.tool_results,
        finished,
        in_flight,
        restarted,
        rebuilt.ended,
        nodes_done,
        nodes_going,
        last,
        made_by if isinstance(made_by, dict) else None,
        accepted,
        ident,
        _top_id(data),
    )


def with_codec(loaded: Loaded, path: str | Path, agent: CompiledAgent, codec: Any) -> None:
    """What `load` checks with a codec, for a journal loaded without one (`agentfsm run --resume` checks it before
    its servers start, and the run goes on with that copy rather than reading it again): the tokenizer it was
    written with, and its token ids in the model's vocabulary (a load with the codec names the first past it)."""
    check_identity(path, loaded.ident, agent, codec, JournalError, _made(loaded.ident))
    vocab = getattr(codec, "vocab_size", None)
    if vocab is not None and loaded.top_id >= vocab:
        load(path, agent, codec)
        raise JournalError(f"{path}: token ids outside the tokenizer's vocabulary ({vocab})")


def _made(ident: dict[str, Any]) -> str:
    """How the journal came to be, for a message: a snapshot is "taken", a run's journal "written"."""
    return "taken" if ident.get("compacted") is True else "written"


def _top_id(data: dict[str, Any]) -> int:
    """The highest token id of a journal's snapshot form (`decoded`'s): tree nodes, closed segments, partial turns."""
    top = -1
    for g in data["groups"]:
        for t in (decode_trajectory(e) for td in g["trajectories"] for e in (td, *td.get("nodes", ()))):
            ids = [seg.prompt_ids for seg in (t, *t.closed)] + [seg.response_ids for seg in (t, *t.closed)]
            top = max(top, *(max(a, default=-1) for a in [*ids, (t.partial_turn or [()])[0]]))
    return top


def refuse_unbegun(loaded: Loaded, path: str | Path) -> None:
    """A run killed between its journal's `run` record and its first group's did nothing: there is nothing to go
    on with (JournalError of one line), and a new run into its directory replaces the journal
    (fsm/output/keep.py `RunDir.unfinished`)."""
    if not loaded.data["groups"]:
        raise JournalError(
            f"{path}: the run there stopped before its first row was recorded: nothing to resume; start it "
            f"again (a new run into {Path(path).parent} replaces this journal)"
        )


def _snapshot_form(
    read: Read | Scan, rebuilt: Rebuilt, agent: CompiledAgent, trees: dict[str, Any]
) -> tuple[dict[str, Any], tuple[int, int, int, int, int], dict[str, int]]:
    ident = rebuilt.identity
    groups, finished, in_flight, restarted, nodes_done, nodes_going = [], 0, 0, 0, 0, 0
    known = rebuilt.versions  # every version the run served (journal.py `weights`); None: not recorded
    # a snapshot's tokens are bounded by its run's weight version when it was taken
    bound = ident.get("weight_version", 0) if ident.get("compacted") is True else None
    newest = max(known) if known is not None else bound or 0  # else the newest weight version of any token
    last: dict[str, int] = {}
    for g in rebuilt.groups:
        if g["members"] and g["members"][0] in rebuilt.taken:  # a consumer has it: not handed out again
            continue
        members = []
        for sid in g["members"]:
            traj = rebuilt.trajs.get(sid)
            if traj is None:
                raise JournalError(f"{read.path}: group {g['uid']!r}: its trajectory {sid!r} has no record")
            # its weight versions are expanded below, before `_check` reads them
            check_version_runs(f"trajectory {sid!r}", traj._version_runs, len(traj.response_ids))
            if known is not None and (forged := {v for v in traj._version_runs[1::2] if v >= 0} - known):
                raise JournalError(
                    f"{read.path}: trajectory {sid!r}: field 'response_versions': weight version {min(forged)} "
                    f"was never served in this run (its weights: {', '.join(map(str, sorted(known)))})"
                )
            done = sid in rebuilt.done
            meta, nodes = trees.get(sid, (None, []))
            inside = any(not e["done"] and decode_trajectory(e).interaction_started for e in nodes)
            if not done and (traj.interaction_started or inside):
                traj = from_whole(rebuilt.first[sid])  # a tree: from its root, all of it again
                meta, nodes = None, []
                restarted += 1
            elif not done and len(traj.path_times) > 0:
                in_flight += 1
                if (span := traj.weight_versions()) is not None:  # versions only grow along a trajectory
                    last[sid] = span[1]
            finished += done
            nodes_done += sum(e["done"] for e in nodes)
            nodes_going += sum(not e["done"] for e in nodes)
            tree = {"n": meta, "nodes": nodes} if meta is not None or nodes else {}
            members.append({"done": done, **decoded(traj), **tree})
        if not members:
            raise JournalError(f"{read.path}: group {g['uid']!r} has no trajectories")
        spans = [rebuilt.trajs[s].weight_versions() for s in g["members"]]
        lows = [s[0] for s in spans if s is not None] or [0]
        highs = [s[1] for s in spans if s is not None] or [0]
        newest = max(newest, *highs) if known is None and bound is None else newest
        decode_sampling(g["sampling"])  # checked again by _check
        held = g.get("held") or {}  # a snapshot's: what its stream knew of the group (checked by _check)
        groups.append(
            {
                "status": "ready" if all(m["done"] for m in members) else "running",
                "uid": g["uid"],
                "reruns": held.get("reruns", g.get("reruns", 0)),
                "version_min": held.get("version_min", min(lows)),
                "version_max": held.get("version_max", max(highs)),
                "sampling": g["sampling"],
                "trajectories": members,
            }
        )
    indices = [t.index for t in rebuilt.trajs.values()]
    meta = ident.get("meta")  # a snapshot's: the caller's (`engine.snapshot(path, meta=...)`)
    if meta is not None and not isinstance(meta, dict):
        raise JournalError(f"{read.path}: record 1: meta is not an object")
    data = {
        "meta": meta
        if meta is not None
        else {
            "groups": len(groups),
            "rows_expected": ident.get("rows_expected", 0),
            "run_id": ident.get("run_id"),
            "spec": ident.get("spec"),
        },
        "weight_version": max(int(ident.get("weight_version", 0) or 0), newest),
        "next_index": max(max(indices) + 1 if indices else 0, ident.get("next_index", 0)),
        "groups": groups,
    }
    expected = ident.get("rows_expected", 0)
    held = sum(len(g["trajectories"]) for g in groups)
    if not isinstance(expected, int) or isinstance(expected, bool) or expected < held:
        raise JournalError(
            f"{read.path}: record 1: rows_expected is not a count of at least its {held} trajectories"
        )
    return data, (finished, in_flight, restarted, nodes_done, nodes_going), last
