"""A journal read back: its records (fsm/run/journal.py `Scan`) folded into the run they describe, each trajectory
as its last record left it. A resume (fsm/run/resume.py), `agentfsm replay` and a Ray chunk's retry read a journal
through `rebuild`; the content is then checked as a snapshot's is (fsm/run/snapcheck.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fsm.run.codec import FORMAT, FORMATS, JournalError, SnapshotError, apply_changes, from_whole
from fsm.run.journal import ACTION_EVENTS, Read, Scan
from fsm.run.trajectory import Trajectory

# the events a reader folds (fsm/run/journal.py names them as it writes: ACTION_EVENTS and `Recorder.step`)
STEP_EVENTS = frozenset(
    {*ACTION_EVENTS.values(), "rewrite", "action", "begin", "failure", "reward", "child_ended"}
)
TRAJ_EVENTS = frozenset({"start", "rewrite", "resume", "child_started", "fork", "snapshot"})


@dataclass
class Rebuilt:
    """A journal replayed into the run it describes: its identity, groups, trajectories, and what was done."""

    identity: dict[str, Any]
    groups: list[dict[str, Any]]  # uid, sampling, members (session ids), in submission order
    trajs: dict[str, Trajectory]  # session id -> as it last was
    first: dict[str, dict[str, Any]]  # session id -> its first whole record (before any action)
    done: set[str] = field(default_factory=set)
    nodes: dict[str, Any] = field(default_factory=dict)  # session id -> its last tree record `n`
    tool_results: dict[str, dict[str, Any]] = field(default_factory=dict)
    ended: str | None = None  # "completed": its files are written
    taken: set[str] = field(default_factory=set)  # groups a consumer took, by their first session id
    # its `resume` records, in order, each with `finished_before`: the trajectories finished before it
    resumes: list[dict[str, Any]] = field(default_factory=list)
    # the weight versions a token may carry (the run's and its `weights` records'); None: a journal from before
    # they were recorded, whose versions are bounded only by the newest a token carries
    versions: set[int] | None = None
    shared: dict[tuple[str, Any], Any] = field(default_factory=dict)  # see `_share`
    format: int = FORMAT  # of the records read now: the `run` record's, then the last `format` record's


def _share(out: Rebuilt, traj: Trajectory) -> None:
    """A row is one object in a run, shared by its samples and tree nodes, and so are a spec's tool schemas; read
    back, each record holds its own copy (2 KB each for the calculator's, half of what a trajectory held): an
    equal one read before is shared again."""
    for name in ("row", "tool_schemas"):
        value = getattr(traj, name)
        key = (name, traj.index if name == "row" else None)
        held = out.shared.get(key)
        if held is not None and held == value:
            setattr(traj, name, held)
        else:
            out.shared[key] = value


def rebuild(read: Read | Scan) -> Rebuilt:
    """Replay the records: each trajectory as its last record left it. JournalError (naming the record) for
    one that does not fit: no `run` record first, a step of an unknown trajectory, a delta that does not
    continue where the last left off, a slot that is not the trajectory's. The content is then checked as a
    snapshot's is (fsm/run/snapcheck.py `_check`, by the caller)."""
    recs = iter(read.records if isinstance(read, Read) else read)
    first = run_record(read.path, next(recs, None))
    out = Rebuilt(first, [], {}, {}, format=first["format"])
    if first.get("weight_updates") is True:
        out.versions = {first.get("weight_version", 0)}
        _version(first.get("weight_version", 0), f"{read.path}: record 1: weight_version")
    for k, rec in enumerate(recs, start=2):
        where = f"{read.path}: record {k}"
        try:
            _apply(out, rec, where)
        except JournalError:
            raise
        except SnapshotError as exc:  # a value the snapshot encoding refuses (an unknown record type)
            raise JournalError(f"{where}: {exc}") from None
        except (KeyError, TypeError, ValueError, AttributeError, IndexError, OverflowError) as exc:
            raise JournalError(
                f"{where}: malformed {rec.get('t')!r} record ({type(exc).__name__}: {exc})"
            ) from None
    return out


def _group(out: Rebuilt, rec: dict[str, Any], where: str) -> None:
    """A `group` record: a new group, or a stale group run again (`reruns`), whose new trajectories take the place
    of the last group of that uid, its old trajectories and their tree nodes dropped."""
    if not isinstance(rec["uid"], str) or not isinstance(rec["members"], list):
        raise JournalError(f"{where}: a group without uid or members")
    group = {"uid": rec["uid"], "sampling": rec["sampling"], "members": list(rec["members"])}
    if "held" in rec:  # a snapshot's: what its stream knew of the group (reruns, weight versions)
        group["held"] = rec["held"]
    reruns = rec.get("reruns", 0)
    if not reruns:
        out.groups.append(group)
        return
    # a stale group run again: its new trajectories take the place of the last group of that uid
    at = next((i for i in reversed(range(len(out.groups))) if out.groups[i]["uid"] == rec["uid"]), None)
    if type(reruns) is not int or reruns < 1 or at is None:
        raise JournalError(f"{where}: a rerun ({reruns!r}) of group {rec['uid']!r}, which no record started")
    gone = set(out.groups[at]["members"])  # the stale trajectories and their tree nodes (`<root>:<path>`)
    for sid in [s for s in out.trajs if s.split(":", 1)[0] in gone]:
        del out.trajs[sid]
        out.first.pop(sid, None)
        out.nodes.pop(sid, None)
    out.groups[at] = {**group, "reruns": reruns}


def _apply(out: Rebuilt, rec: dict[str, Any], where: str) -> None:
    kind = rec["t"]
    if kind == "group":
        _group(out, rec, where)
    elif kind == "traj":
        sid = rec["s"]
        if sid in out.done:
            raise JournalError(f"{where}: trajectory {sid!r} again after it finished (a row twice)")
        _event(out, rec, TRAJ_EVENTS, where)
        traj = from_whole(rec["d"])
        if traj.session_id != sid:
            raise JournalError(f"{where}: a trajectory record of {sid!r} holds {traj.session_id!r}")
        _share(out, traj)
        out.first.setdefault(sid, rec["d"])
        out.trajs[sid] = traj
        _node(out, rec, sid, where)
        if rec.get("done"):
            _finished(out, traj, sid, where)
    elif kind == "step":
        sid = rec["s"]
        found = out.trajs.get(sid)
        if found is None:
            raise JournalError(f"{where}: a step of trajectory {sid!r}, which no record started")
        traj = found
        if sid in out.done:
            raise JournalError(f"{where}: a step of trajectory {sid!r} after it finished")
        _event(out, rec, STEP_EVENTS, where)
        apply_changes(traj, rec, where, out.format)
        _node(out, rec, sid, where)
        if rec.get("done"):
            _finished(out, traj, sid, where)
    elif kind == "tool":
        outcome = rec.get("o", rec.get("attempt"))
        if not isinstance(rec["k"], str) or not isinstance(outcome, dict):
            raise JournalError(f"{where}: a tool record without key or outcome")
        if "o" in rec and outcome.get("error") is None:  # a failure (an older journal's too) is no result
            out.tool_results[rec["k"]] = outcome
    elif kind == "weights":
        _version(rec["v"], f"{where}: a weights record's version")
        if out.versions is not None:
            out.versions.add(rec["v"])
    elif kind == "end":
        out.ended = str(rec["status"])
    elif kind == "taken":
        sessions = rec["s"]
        if not isinstance(sessions, list) or not all(s in out.trajs for s in sessions):
            raise JournalError(f"{where}: a taken record of trajectories no record started")
        out.taken.update(sessions)
    elif kind == "resume":
        if not isinstance(rec.get("made_by"), dict) or not isinstance(rec.get("accepted"), list):
            raise JournalError(f"{where}: a resume record without made_by or accepted")
        out.resumes.append({**rec, "finished_before": len(out.done)})
        _let_go(out, rec.get("trees_over", []), where)
        if "format" in rec:  # format 3's said the format of the records after it (format 2's did not)
            out.format = _format(rec["format"], where)
    elif kind == "format":  # the records after it are of this format (journal.py `Recorder.resumed`)
        out.format = _format(rec["format"], where)
    elif kind == "run":
        raise JournalError(f"{where}: a second 'run' record (two runs in one journal)")
    else:
        raise JournalError(f"{where}: unknown record kind {kind!r}")


def run_record(path: Any, first: dict[str, Any] | None) -> dict[str, Any]:
    """A journal's first record, its `run` record of a format this version reads; JournalError of one line."""
    if first is None or first.get("t") != "run":
        raise JournalError(f"{path}: not an agentfsm journal of format {FORMAT} (no 'run' record first)")
    _format(first.get("format"), f"{path}: record 1")
    return first


def _format(value: Any, where: str) -> int:
    """A format this version reads; a newer agentfsm's records are refused, never folded by these rules."""
    if value in FORMATS and type(value) is int:
        return int(value)
    if type(value) is int and value > FORMAT:
        raise JournalError(
            f"{where}: records of format {value}, written by a newer agentfsm; this version reads formats "
            f"{FORMATS[0]}-{FORMAT}: read the journal with the version that wrote it"
        )
    raise JournalError(
        f"{where}: format {value!r} is not an agentfsm journal's (this version reads {FORMATS})"
    )


def _event(out: Rebuilt, rec: dict[str, Any], known: frozenset[str], where: str) -> None:
    """A record's event is one this reader folds (a journal of format 1 names none: its steps are slots alone)."""
    ev = rec.get("ev")
    if ev not in known and (ev is not None or out.format != 1):
        raise JournalError(
            f"{where}: unknown event {ev!r} (known: {', '.join(sorted(known))}); written by another agentfsm "
            "version, or forged: resume it with the version that wrote it"
        )


def _version(value: Any, what: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 2**31:
        raise JournalError(f"{what} {value!r} is not a weight version (an int32 >= 0)")


def _node(out: Rebuilt, rec: dict[str, Any], sid: str, where: str) -> None:
    """A record's tree place `n` (checked against its tree by fsm/run/treejournal.py `tree_form`)."""
    if "n" in rec:
        if not isinstance(rec["n"], dict):
            raise JournalError(f"{where}: its tree record 'n' is not an object")
        out.nodes[sid] = rec["n"]


def _finished(out: Rebuilt, traj: Trajectory, sid: str, where: str) -> None:
    """A record saying a trajectory finished must hold a finished one: its row goes out as written. Its first
    record is let go: only an unfinished one starts over from it, and a journal of finished rows held them all
    (a fifth of what reading one back took)."""
    if not isinstance(traj.termination_reason, str) or not traj.termination_reason:
        raise JournalError(f"{where}: trajectory {sid!r} finished without a termination reason")
    out.done.add(sid)
    out.first.pop(sid, None)


def _let_go(out: Rebuilt, roots: Any, where: str) -> None:
    """A resume's roots whose trees start over (fsm/run/journal.py `resumed`): their nodes journaled before it run
    again under the same session ids, finished ones too, and are read from their new records alone."""
    if not isinstance(roots, list) or not all(isinstance(r, str) and r in out.trajs for r in roots):
        raise JournalError(f"{where}: a resume record's trees_over names trajectories no record started")
    for root in roots:
        for sid in [s for s in out.trajs if s.startswith(f"{root}:")]:
            del out.trajs[sid]
            out.first.pop(sid, None)
            out.nodes.pop(sid, None)
            out.done.discard(sid)
