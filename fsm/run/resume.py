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

What made the rows: the journal's `run` record holds `made_by` (below: the model's weights or
the servers' model, the code the spec names, the engine's options), and every resume appends a `resume` record
with what it runs on and the changes it accepted; a resume compares with the last of them. Weights: every model
token keeps the weight version that made it, in the journal as in the batch, and a resumed row keeps its tokens'
versions. A row goes on only with the weights it was generated with: when the servers now serve another version
than the unfinished rows' last tokens came from (an update between the kill and the resume), that is a change
too (`weights_change`). A change refuses the resume in one line, unless the caller accepts changes
(`--accept-changes`, `RunDir(out, accept_changes=True)`): then their next tokens carry the servers' version, as
after an update in the continuous mode, and the journal records what was accepted.

What made the rows (issue 46): their tokens come from the model's weights, their rewards and observations from
the code the spec names (the reward function, tools, guards, actions, the interaction), their form from the
engine's options. The spec and the tokenizer are checked by hash (`load`); the rest is `made_by`:

- `model`: the embedded model by a digest of its checkpoint (`checkpoint_digest`), a model object in memory by its
  name only (its weights are the caller's); servers by the model name they serve and their engine (their weight
  version is checked per row, `weights_change`: an update between the kill and the resume moves it);
- `code`: each module the spec (and its child machines' specs) names, by the sha256 of its source file;
- `engine`: the options that shape rows on resume (--check-tokens; the embedded model's dtype, device and
  --exact-logprobs).

Every difference is a `Change`; `judge` refuses the resume in one line naming the first (and counting the
others), or, with changes accepted, hands them back to be warned about and recorded in the journal (a `resume`
record, which `agentfsm show --journal` and `agentfsm replay` print), so rows made before and after can be told
apart.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import re
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fsm.run.agent import CompiledAgent
from fsm.run.codec import (
    decode_sampling,
    decode_trajectory,
    decoded,
    from_whole,
    tokenizer_id,
)
from fsm.run.engine import LocalEngine
from fsm.run.fold import Rebuilt, rebuild, run_record
from fsm.run.journal import JournalError, Read, Scan
from fsm.run.snapcheck import _check, check_identity, check_version_runs
from fsm.run.trajectory import Trajectory
from fsm.run.treejournal import restart_failed, starts_over, tree_form
from fsm.spec.registry import is_import_path


@dataclass
class Loaded:
    """A journal ready to be resumed: `data` in a snapshot's form (Stream.restore's input)."""

    data: dict[str, Any]
    good_bytes: int  # where the journal's writer goes on (a torn last record is cut off)
    torn: str | None  # one line: what a torn last record lost
    tool_results: dict[str, dict[str, Any]]
    finished: int  # trajectories finished before
    in_flight: int  # trajectories that go on from their last boundary: their current action runs again
    restarted: int  # trajectories that start over (inside their interaction, or failed and not ended)
    ended: str | None
    nodes_finished: int = 0  # tree nodes (child machines, branches) finished before: taken back as they are
    nodes_in_flight: int = 0  # tree nodes that go on from their last boundary
    last_versions: dict[str, int] = field(default_factory=dict)  # session -> the weight version of the last
    # model token of each trajectory that goes on (none for one without model tokens, or that starts over)
    # what made the rows (below): the last resume's, else the run's; None in an older journal
    made_by: dict[str, Any] | None = None
    accepted: list[str] = field(default_factory=list)  # the changes earlier resumes accepted, in order
    ident: dict[str, Any] = field(default_factory=dict)  # its `run` record
    top_id: int = -1  # the highest token id of its trajectories (`with_codec` bounds it by the vocabulary)
    nodes_restarted: int = 0  # tree nodes that start over (treejournal.py `restart_failed`)
    trees_over: list[str] = field(default_factory=list)  # roots whose trees start over, nodes and all


def weights_change(loaded: Loaded, now: int, served_by: str) -> Change | None:
    """None when the unfinished rows go on with the weights they were generated with (the newest version among
    their last tokens, as the continuous mode serves them); else the change, naming the servers and both
    versions (`judge` refuses it, or records it accepted)."""
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
    return run_record(path, next(iter(Scan(path)), None))  # the first record only: the rest is read by `load`


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
    over: list[str] = []
    try:
        data, counts, last = _snapshot_form(read, rebuilt, agent, trees, over)
        _check(data, agent, vocab)
    except JournalError:
        raise
    except Exception as exc:  # SnapshotError and the malformed kinds: one line naming the journal
        raise JournalError(f"{path}: {exc}") from None
    finished, in_flight, restarted, nodes_done, nodes_going, nodes_again = counts
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
        nodes_again,
        over,
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
    read: Read | Scan, rebuilt: Rebuilt, agent: CompiledAgent, trees: dict[str, Any], over: list[str]
) -> tuple[dict[str, Any], tuple[int, ...], dict[str, int]]:
    ident = rebuilt.identity
    groups, finished, in_flight, restarted, nodes_done, nodes_going, nodes_again = [], 0, 0, 0, 0, 0, 0
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
            _check_versions(read, sid, traj, known)
            done = sid in rebuilt.done
            meta, nodes = trees.get(sid, (None, []))
            nodes, again = restart_failed(nodes, rebuilt.first)
            inside = any(not e["done"] and starts_over(decode_trajectory(e)) for e in nodes)
            # its failure journaled, its end not (a kill between them): it starts over, as one inside its
            # interaction does, rather than run its failed action again with the failure on it; a tree does
            # when one of its unfinished nodes would and cannot alone (`restart_failed`)
            if not done and (inside or starts_over(traj)):
                traj = from_whole(rebuilt.first[sid])  # a tree: from its root, all of it again
                over += [sid] if nodes else []  # its nodes' records let go on reading (journal.py `resumed`)
                meta, nodes = None, []
                restarted += 1
            elif not done and len(traj.path_times) > 0:
                in_flight += 1
                if (span := traj.weight_versions()) is not None:  # versions only grow along a trajectory
                    last[sid] = span[1]
            finished += done
            nodes_done += sum(e["done"] for e in nodes)
            nodes_going += sum(not e["done"] for e in nodes) - (again if nodes else 0)
            nodes_again += again if nodes else 0
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
    data = _run_form(read, rebuilt, groups, newest)
    return data, (finished, in_flight, restarted, nodes_done, nodes_going, nodes_again), last


def _check_versions(read: Read | Scan, sid: str, traj: Trajectory, known: set[int] | None) -> None:
    """A trajectory's weight versions are well formed and (when the run recorded them) each one it served."""
    # its weight versions are expanded by the caller, before `_check` reads them
    check_version_runs(f"trajectory {sid!r}", traj._version_runs, len(traj.response_ids))
    if known is not None and (forged := {v for v in traj._version_runs[1::2] if v >= 0} - known):
        raise JournalError(
            f"{read.path}: trajectory {sid!r}: field 'response_versions': weight version {min(forged)} "
            f"was never served in this run (its weights: {', '.join(map(str, sorted(known)))})"
        )


def _run_form(
    read: Read | Scan, rebuilt: Rebuilt, groups: list[dict[str, Any]], newest: int
) -> dict[str, Any]:
    """The run around its groups, in the snapshot's form: its meta, weight version and next row index."""
    ident = rebuilt.identity
    indices = [t.index for t in rebuilt.trajs.values()]
    meta = ident.get("meta")  # a snapshot's: the caller's (`engine.snapshot(path, meta=...)`)
    if meta is not None and not isinstance(meta, dict):
        raise JournalError(f"{read.path}: record 1: meta is not an object")
    expected = ident.get("rows_expected", 0)
    held = sum(len(g["trajectories"]) for g in groups)
    if not isinstance(expected, int) or isinstance(expected, bool) or expected < held:
        raise JournalError(
            f"{read.path}: record 1: rows_expected is not a count of at least its {held} trajectories"
        )
    return {
        "meta": meta
        if meta is not None
        else {
            "groups": len(groups),
            "rows_expected": expected,
            "run_id": ident.get("run_id"),
            "spec": ident.get("spec"),
        },
        "weight_version": max(int(ident.get("weight_version", 0) or 0), newest),
        "next_index": max(max(indices) + 1 if indices else 0, ident.get("next_index", 0)),
        "groups": groups,
    }


# --- what made the rows -------------------------------------------------------------------------------------

ACCEPT = "rerun with --resume --accept-changes (RunDir(out, accept_changes=True)) to go on anyway"
# the files of a checkpoint that decide what it computes: the weights in every format, and the configs
WEIGHT_FILES = re.compile(r".*\.(safetensors|bin|pt|pth|gguf|msgpack|h5)|(generation_)?config\.json")
_DOTTED = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")
# a spec's top-level keys, named for the message ("the reward module specs/calculator.py")
_ROLES = {"reward": "reward", "tools": "tool", "states": "action or guard", "context": "rewrite"}
_ROLES |= {"imports": "imported", "demo_data": "demo data", "children": "child"}


@dataclass(frozen=True)
class Change:
    """One difference between what made a run's rows and what a resume runs on: `what` names it (one clause);
    `fix` says how to resume without it, where there is a way; `after` what accepting it means."""

    what: str
    fix: str | None = None
    after: str | None = None


class ResumeRefused(JournalError):
    """What made a journal's rows changed, and the caller did not accept changes: one line, `resume refused:`."""


def judge(path: str | Path, changes: list[Change], accept: bool) -> list[str]:
    """Nothing back when nothing changed; with `accept`, the changes as lines to warn about and record; else
    ResumeRefused of one line: `resume refused:` the journal, the first change (and how many more), the way on."""
    if not changes:
        return []
    if accept:
        return [c.what + (f" ({c.after})" if c.after else "") for c in changes]
    first = changes[0]
    more = f" (and {len(changes) - 1} more: {'; '.join(c.what for c in changes[1:])})" if changes[1:] else ""
    fix = f"; {first.fix}, or {ACCEPT}" if first.fix else f"; {ACCEPT}"
    raise ResumeRefused(f"resume refused: {path}: {first.what}{more}{fix}")


# --- digests -------------------------------------------------------------------------------------------------


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def checkpoint_digest(folder: Path) -> str:
    """One sha256 over the checkpoint's weight and config files (name, size, content), top level only (a
    checkpoint's own files; the folders beside them are other checkpoints). A file's sha256 is cached by its
    path, size, mtime, ctime and inode in ~/.cache/agentfsm/sha256.json: read once, whatever its size."""
    cache_path = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "agentfsm" / "sha256.json"
    try:
        cache = json.loads(cache_path.read_text())
        cache = cache if isinstance(cache, dict) else {}
    except (OSError, ValueError):
        cache = {}
    h, grew = hashlib.sha256(), False
    for f in sorted(p for p in folder.iterdir() if p.is_file() and WEIGHT_FILES.fullmatch(p.name)):
        st = f.stat()
        # ctime and inode too: a copy that keeps the size and mtime (`cp -p`, shutil.copy2) still changes them
        key = f"{f.resolve()}|{st.st_size}|{st.st_mtime_ns}|{st.st_ctime_ns}|{st.st_ino}"
        digest = cache.get(key)
        if not isinstance(digest, str):
            digest, grew = file_sha256(f), True
            cache[key] = digest
        h.update(f"{f.name}\0{st.st_size}\0{digest}\n".encode())
    if grew:
        with contextlib.suppress(OSError):  # a cache that cannot be written costs a read next time, no more
            cache_path.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache_path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(cache))
            tmp.replace(cache_path)
    return h.hexdigest()


def _refs(value: Any) -> Iterator[str]:
    """Every string in a spec's data, keys included (a guard may be named by import path as a key)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, Mapping):
        for k, v in value.items():
            yield from _refs(k)
            yield from _refs(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _refs(v)


def _named_modules(agent: CompiledAgent, whose: str, found: dict[str, list[str]], seen: set[int]) -> None:
    """The modules `agent`'s spec names, each with its roles (`whose`: "" for the root, "child NAME's " for a
    child machine's spec, read the same way), into `found`."""
    seen.add(id(agent))
    for key, value in agent.spec.model_dump(by_alias=True, exclude_none=True).items():
        role = whose + _ROLES.get(key, key)
        for ref in _refs(value) if key != "imports" else value:
            module = ref.split(":", 1)[0] if is_import_path(ref) else ref if key == "imports" else None
            if module and _DOTTED.fullmatch(module) and role not in found.setdefault(module, []):
                found[module].append(role)
    for name in agent.spec.children:
        child = agent.child_agent(name)
        if id(child) not in seen:
            _named_modules(child, f"child {name}'s ", found, seen)


def code_digests(agent: CompiledAgent) -> dict[str, dict[str, str]]:
    """module -> {"file", "sha256", "as"} for every module the spec names (by import path, or under
    `imports:`), its child machines' specs included, as compiled: the ones it imported (nothing is imported
    here). A module with no source file (built in) is left out. The file is read now: a process that imported a
    module before it was edited is told apart by what is on disk, which is what a fresh process would run."""
    found: dict[str, list[str]] = {}
    _named_modules(agent, "", found, set())
    out = {}
    for module, roles in found.items():
        # compiling the spec imported every module it names; any other string (a prompt's "Note: ...") is none
        file = getattr(sys.modules.get(module), "__file__", None)
        if file is not None and (path := Path(file)).is_file():
            out[module] = {"file": str(path.resolve()), "sha256": file_sha256(path), "as": ", ".join(roles)}
    return out


# --- what an engine runs on ----------------------------------------------------------------------------------


def model_of(backend: Any) -> dict[str, Any]:
    """What makes a backend's tokens: servers (the model they serve, their engine), the embedded model (its
    checkpoint's digest; a model object in memory: its name), or another backend (its kind and model name)."""
    servers = getattr(backend, "servers", None)
    if servers is not None or getattr(backend, "url", None) is not None:
        clients = [s.backend for s in servers] if servers is not None else [backend]
        engines = sorted({type(c).__name__ for c in clients})
        return {"kind": "servers", "model": str(getattr(backend, "model_name", None)), "engine": engines}
    if hasattr(backend, "checkpoint"):  # the embedded model (backends/hf.py)
        entry: dict[str, Any] = {"kind": "embedded", "model": str(backend.model_name)}
        where = backend.checkpoint
        if where is not None and Path(where).is_dir():
            entry["checkpoint"] = str(Path(where).resolve())
            entry["sha256"] = checkpoint_digest(Path(where))
        elif where is not None:  # a hub id: its revision
            entry["checkpoint"] = str(where)
            entry["revision"] = getattr(getattr(backend.model, "config", None), "_commit_hash", None)
        return entry
    return {"kind": type(backend).__name__, "model": str(getattr(backend, "model_name", None))}


def options_of(engine: LocalEngine) -> dict[str, Any]:
    """The engine's options that shape rows on resume (the rows' sampling comes from the journal)."""
    out: dict[str, Any] = {"check_tokens": bool(engine.runner.check_tokens)}
    backend: Any = engine.backend  # the in-process model's options, where it is one (it has a checkpoint)
    if hasattr(backend, "checkpoint"):
        out["dtype"] = str(backend.dtype).removeprefix("torch.")
        out["device"] = getattr(backend.device, "type", str(backend.device))
        out["exact_logprobs"] = bool(getattr(backend, "exact_logprobs", False))
    return out


async def made_by(engine: LocalEngine) -> dict[str, Any]:
    """What `engine` makes rows with (started: servers have said what they serve), for the journal's `made_by`.
    A checkpoint's digest reads its files on a thread (once: then cached)."""
    await engine.start()

    def collect() -> dict[str, Any]:
        policies = {
            name: model_of(p.backend)
            for name, p in sorted(engine.runner.policies.items())
            if p.backend is not None and p.backend is not engine.backend
        }
        out = {
            "model": model_of(engine.backend),
            "code": code_digests(engine.agent),
            "engine": options_of(engine),
        }
        return {**out, "policies": policies} if policies else out

    return await asyncio.to_thread(collect)


# --- differences ---------------------------------------------------------------------------------------------


def _sha256s(was: Any, now: Any) -> str:
    return "sha256 " + " -> ".join(f"{str(d)[:8]}.." if d else "none" for d in (was, now))


def _shown(file: str) -> str:
    """A path as a user would type it: relative to the working directory when under it."""
    with contextlib.suppress(ValueError):
        return str(Path(file).relative_to(Path.cwd()))
    return file


def _describe(m: Mapping[str, Any]) -> str:
    if m.get("kind") == "servers":
        return f"servers serving {m.get('model')!r} ({', '.join(m.get('engine') or [])})"
    if m.get("kind") == "embedded":
        return f"the embedded model {m.get('model')!r}" + (
            f" from {m['checkpoint']}" if m.get("checkpoint") else " (a model object in memory)"
        )
    return f"a {m.get('kind')} backend ({m.get('model')!r})"


def model_changes(before: Mapping[str, Any], now: Mapping[str, Any], whose: str = "") -> list[Change]:
    other = f"the run's rows{whose} were made by {_describe(before)}, but this resume runs {_describe(now)}"
    if before.get("kind") != now.get("kind"):
        fix = "give the servers again with --server URL" if before.get("kind") == "servers" else None
        return [Change(other, fix)]
    if now.get("kind") == "servers":
        out = []
        was, serves = before.get("model"), now.get("model")
        if was != serves and not {was, serves} & {"unknown", "None"}:  # "unknown": servers not read at start
            msg = f"the servers{whose} serve model {serves!r}, but the run's rows were made by {was!r}"
            out.append(Change(msg, f"give servers of {was!r}"))
        if before.get("engine") != now.get("engine"):
            ran = f"the servers{whose} run {now.get('engine')}, the run's ran {before.get('engine')}"
            out.append(Change(ran))
        return out
    if now.get("sha256") or before.get("sha256"):  # a checkpoint's files: the same, wherever they are now
        same = before.get("sha256") == now.get("sha256")
    else:  # a hub id at its revision, a model object in memory, another backend: by name
        same = all(before.get(k) == now.get(k) for k in ("model", "checkpoint", "revision"))
    if same:
        return []
    if before.get("checkpoint") == now.get("checkpoint") and before.get("checkpoint"):
        digests = _sha256s(before.get("sha256"), now.get("sha256"))
        msg = f"the model's checkpoint{whose} {now['checkpoint']} changed since the run started ({digests})"
        return [Change(msg)]
    return [Change(other)]


def changes(before: Mapping[str, Any] | None, now: Mapping[str, Any]) -> list[Change]:
    """What differs between `before` (a journal's `made_by`; None in a journal older than it: nothing to
    compare) and `now` (the parts it holds: the CLI checks the code before it loads a model)."""
    if not before:
        return []
    out = model_changes(before.get("model") or {}, now["model"]) if "model" in now else []
    was_p, now_p = before.get("policies") or {}, now.get("policies") or {}
    for name in sorted(set(was_p) | set(now_p)) if "model" in now else ():
        out += model_changes(was_p.get(name) or {}, now_p.get(name) or {}, f" of policy {name!r}")
    was_c, now_c = before.get("code") or {}, now.get("code") or {}
    for module, was in was_c.items() if "code" in now else ():
        cur = now_c.get(module)
        if cur is None:
            gone = f"the {was.get('as')} module {module} ({_shown(was.get('file', '?'))}) is gone"
            out.append(Change(gone))
        elif cur.get("sha256") != was.get("sha256"):
            file = _shown(cur.get("file", module))
            digests = _sha256s(was.get("sha256"), cur.get("sha256"))
            msg = f"the {was.get('as')} module {file} changed since the run started ({digests})"
            out.append(Change(msg, f"put {file} back as it was"))
    was_e, now_e = before.get("engine") or {}, now.get("engine") or {}
    for key in sorted(set(was_e) & set(now_e)):
        if was_e[key] != now_e[key]:
            flag, was = "--" + key.replace("_", "-"), was_e[key]
            fix = f"resume {'with' if was else 'without'} {flag}" if isinstance(was, bool) else None
            fix = fix or f"resume with {flag} {was}"
            out.append(Change(f"{flag} is {now_e[key]!r}, the run's was {was!r}", fix))
    return out
