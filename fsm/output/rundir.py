"""The run directory `agentfsm run --out DIR` writes: batch.pt, trajectories.jsonl and summary.json, replaced
together so that DIR never holds a mix of two runs; the records and statistics in them and the summary's table.

`write_run(out, write)` has `write(staging)` put the three files into a fresh directory inside `out` (the same
filesystem: a rename is atomic), then removes the previous run's files, summary.json first, and renames the
new ones in, summary.json last, with Ctrl-C held off: a summary.json always describes the files beside it, and
a directory without one holds no complete run. Per-file renames, not a directory swap, because `out` may hold
other things (sglang_logs/, a rendered diagram) or be ".".

`trajectory_record` makes a trajectories.jsonl record and `read_records` reads them back; `run_stats` makes
the "fsm" section of summary.json (edges fired, time per state, how runs ended; a tree counts every node) and
`load_run_stats` reads it back for viz/diagram.py (formats: docs/contracts.md).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import signal
import stat
import tempfile
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

from fsm.run.tree import nodes_of, tree_fields, tree_record

T = TypeVar("T")
LOCK_FILE = ".agentfsm.lock"  # held by the run writing into the directory (fcntl.flock: freed when it exits)
# summary.json last: it vouches for the rest
OUTPUT_FILES = ("batch.pt", "trajectories.jsonl", "summary.json")


POLICY_BATCHES = "batch.*.pt"


def policy_batch_file(policy: str) -> str:
    """The file of one policy's batch in a several-policy run."""
    return f"batch.{policy}.pt"


def json_text(value: Any, **options: Any) -> str:
    """JSON as the run's files hold it: strict (NaN and Infinity are not JSON and most readers refuse them), so
    a non-finite number raises ValueError here instead of reaching a file; rewards are checked where they enter
    (fsm/run/runtime.py, fsm/run/actions.py)."""
    return json.dumps(value, allow_nan=False, **options)


class WriteInterrupted(Exception):
    """Ctrl-C arrived during `write_run`; `committed`: whether the new run had replaced the old one by then
    (if not, `out` holds what it held before)."""

    def __init__(self, committed: bool):
        super().__init__("committed" if committed else "not committed")
        self.committed = committed


class RunDirError(Exception):
    """The run directory cannot be used: the message names it and says why."""


def prepare(path: str | Path) -> Path:
    """--out as an absolute path (a tool that changes the working directory cannot move it), made and
    checked writable now: a bad directory fails before the rollout, not after it."""
    out = Path(path).expanduser().resolve()
    if out.exists() and not out.is_dir():
        raise RunDirError(f"{out}: exists and is not a directory; pass a directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".agentfsm-probe-", dir=out)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise RunDirError(f"{out}: cannot write there ({exc.strerror or exc})") from None
    return out


# directories this process holds the lock of (a POSIX lock does not refuse its owner)
_HELD: set[Path] = set()


@contextlib.contextmanager
def locked(out: Path) -> Iterator[None]:
    """Hold the directory's lock for the block: a second run into it refuses at once, rather than racing
    this one's files. The lock is the kernel's POSIX record lock (lockf), which, unlike flock, forked
    children do not inherit: a killed run leaves none behind, even while its tool processes live on. The
    lock file is opened without following a link (a planted link's target is never written) and must be a
    regular file."""
    import fcntl

    path = out / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        why = "a symbolic link" if exc.errno == errno.ELOOP else exc.strerror or str(exc)
        raise RunDirError(f"{out}: its lock file {LOCK_FILE} cannot be used ({why}); remove it") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise RunDirError(f"{out}: its lock file {LOCK_FILE} is not a regular file; remove it")
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "another process"
        if out in _HELD:
            raise _busy(out, os.getpid())
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise _busy(out, holder) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        _HELD.add(out)
        remove_leftovers(out)
        try:
            yield
        finally:
            _HELD.discard(out)
    finally:
        os.close(fd)


def _busy(out: Path, pid: object) -> RunDirError:
    return RunDirError(
        f"{out}: another agentfsm run (pid {pid}) is writing there; wait for it or pass another --out"
    )


LEFTOVERS = (".agentfsm-writing-*", ".journal-*")  # a killed run's temporaries (write_run's, Writer's copy)


def remove_leftovers(out: Path) -> None:
    """What a run killed while writing left in `out` (its outputs' staging directory, a journal's copy under
    way): removed by the next holder of the directory's lock (`locked`), under which no other run writes there.
    Only our own temporaries, by name; a link is removed, never followed."""
    for pattern in LEFTOVERS:
        for path in out.glob(pattern):
            with contextlib.suppress(OSError):
                if path.is_dir() and not path.is_symlink():
                    shutil.rmtree(path)
                else:
                    path.unlink()


def fallback_dir() -> Path:
    """Where a run's outputs go when --out refuses them at the end (a full disk, a directory made read-only
    meanwhile): a fresh directory in the system's temporary directory, named in the error."""
    return Path(tempfile.mkdtemp(prefix="agentfsm-unsaved-run-"))


@contextlib.contextmanager
def ctrl_c_held() -> Iterator[None]:
    """Hold Ctrl-C off (main thread only): the block finishes, then the interrupt lands as KeyboardInterrupt."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous if previous is not None else signal.default_int_handler)
    if caught:
        raise KeyboardInterrupt


def write_run(out: Path, write: Callable[[Path], T]) -> T:
    """`write(staging)` writes OUTPUT_FILES into `staging`; they then replace those in `out` (see above).
    OSError passes through; KeyboardInterrupt becomes WriteInterrupted."""
    staging = Path(tempfile.mkdtemp(prefix=".agentfsm-writing-", dir=out))
    committed = False
    try:
        result = write(staging)
        # a several-policy run writes batch.<policy>.pt, one per policy, in place of batch.pt (docs/trees.md)
        names = [n for n in OUTPUT_FILES if (staging / n).exists()]
        names[:0] = sorted(p.name for p in staging.glob(POLICY_BATCHES))
        with ctrl_c_held():
            old = [*OUTPUT_FILES[:-1], *(p.name for p in out.glob(POLICY_BATCHES)), OUTPUT_FILES[-1]]
            for name in reversed(old):  # summary.json first: without it, nothing here vouches
                (out / name).unlink(missing_ok=True)
            for name in names:
                os.replace(staging / name, out / name)
            committed = True
        return result
    except KeyboardInterrupt:
        raise WriteInterrupted(committed) from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def reason_key(traj: Any) -> str:
    """A row's termination reason as summary.json groups it (here and in fsm/output/batch.py's `summarize`): a
    failure by its kind ("error: backend", fsm/run/trajectory.py `Failure`)."""
    if traj.failure is not None:
        return f"error: {traj.failure.kind}"
    return traj.termination_reason or "?"


def harness_failure(record: dict[str, Any]) -> str | None:
    """How a row's harness failed, one line (the last line of its error: a traceback's says why); None when it
    returned or exited 0 (fsm/gateway/harness.py's `harness_failed`)."""
    outcome = record.get("harness")
    if (
        not isinstance(outcome, dict)
        or outcome.get("outcome") in (None, "returned")
        or (outcome.get("outcome") == "exit" and outcome.get("exit_code") in (None, 0))
    ):
        return None
    lines = [line.strip() for line in str(outcome.get("error") or "").splitlines() if line.strip()]
    kind = outcome["outcome"] if outcome["outcome"] != "exit" else f"exit {outcome.get('exit_code')}"
    return f"{kind}: {lines[-1]}" if lines else str(kind)


def run_stats(agent: Any, trajectories: Sequence[Any] | None = None) -> dict[str, Any]:
    """Statistics of finished trajectories (`run_stats(agent, trajs)`, or `run_stats(trajs)` without the
    agent, which then leaves out guard labels and reasons)."""
    if trajectories is None:
        agent, trajectories = None, agent
    edges: dict[int, dict[str, Any]] = {}
    states: dict[str, dict[str, Any]] = {}
    if agent is not None:
        edges = {e.index: _edge(e.source, e.dest, e.label, e.reason) for e in agent.edges}
        states = {name: _state() for name in agent.spec.states}
    timed: dict[str, int] = {}  # visits with a duration (not a final state, not the state a failure left)
    reasons: dict[str, int] = {}
    finals: dict[str, dict[str, int]] = {}
    per_trajectory: dict[int, int] = {}  # segments -> trajectories
    for root in trajectories:
        in_tree: set[int] = set()  # edges that fired anywhere in this tree
        for traj, start, parent in machine_nodes(root, agent):
            path, times, fired = traj.path, getattr(traj, "path_times", ()), traj.transitions_fired
            own = max(0, start - 1)  # a branch's first own edge and timed visit: the forking state's
            # a branch's times hold one more entry per fork above it: its driver's start, the time it entered
            # the forking state (the copied entry before it is its parent's)
            shift = max(0, len(times) - len(path))
            for k in range(own, len(fired)):
                index = fired[k]
                e = edges.get(index)
                if e is None:  # no agent given: what the path says
                    e = edges[index] = _edge(path[k], path[k + 1])
                e["count"] += 1
                in_tree.add(index)
            for k in range(own, len(path)):
                s = states.setdefault(path[k], _state())
                s["visits"] += int(k >= start)  # the forking state was entered once, by the node that forked
                if k + 1 + shift < len(times):  # left the state: it has a duration
                    s["total_s"] += times[k + 1 + shift] - times[k + shift]
                    timed[path[k]] = timed.get(path[k], 0) + 1
            _count_retries(traj, parent, states)
            _count_segments(traj, edges, states, own)
            if not traj.node.forked:  # a training row
                n_segments = getattr(traj, "num_segments", 1)
                per_trajectory[n_segments] = per_trajectory.get(n_segments, 0) + 1
            key = reason_key(traj)
            reasons[key] = reasons.get(key, 0) + 1
            if traj.error is not None:
                states[traj.state]["failed"] += 1
            else:
                final = finals.setdefault(traj.state, {})
                final[key] = final.get(key, 0) + 1
        for index in in_tree:
            edges[index]["trajectories"] += 1
    n = len(trajectories)
    for e in edges.values():
        e["share"] = round(e["trajectories"] / n, 6) if n else 0.0
    for name, s in states.items():
        s["mean_s"] = s["total_s"] / timed[name] if timed.get(name) else None
    return {
        "trajectories": n,
        "agent": getattr(agent, "name", None),
        "agent_hash": getattr(agent, "hash", None),
        "edges": {str(i): edges[i] for i in sorted(edges)},
        "states": states,
        "termination_reasons": dict(sorted(reasons.items(), key=lambda kv: -kv[1])),
        "final_states": finals,
        "segments": {
            "rows": sum(k * v for k, v in per_trajectory.items()),
            "rewritten": sum(v for k, v in per_trajectory.items() if k > 1),
            "per_trajectory": {str(k): per_trajectory[k] for k in sorted(per_trajectory)},
        },
        "trees": tree_stats(trajectories),
    }


def _edge(source: str, dest: str, guard: str | None = None, reason: str | None = None) -> dict[str, Any]:
    return {"source": source, "dest": dest, "guard": guard, "reason": reason, "count": 0, "trajectories": 0}


def _state() -> dict[str, Any]:
    return {"visits": 0, "total_s": 0.0, "failed": 0}


def machine_nodes(root: Any, agent: Any = None) -> Iterator[tuple[Any, int, Any]]:
    """The nodes of `root`'s tree that run its machine, each with where its own path begins and the node it
    forked from (None but for a branch): a fork's branch repeats its parent's path up to the fork, which the
    parent counts (docs/trees.md). A child machine of another spec (planner_solver's solver) is not drawn on
    this diagram, nor is its subtree."""
    machine = getattr(agent, "hash", None) or getattr(root.node.agent, "hash", None)

    def walk(traj: Any, start: int, parent: Any) -> Iterator[tuple[Any, int, Any]]:
        yield traj, start, parent
        for sub in traj.node.nodes:
            if sub.node.kind == "branch":
                yield from walk(sub, len(traj.path), traj)
            elif getattr(sub.node.agent, "hash", None) == machine:
                yield from walk(sub, 0, None)

    yield from walk(root, 0, None)


def _count_retries(traj: Any, parent: Any, states: dict[str, dict[str, Any]]) -> None:
    """A state's retries and catches (the failure rules'). A branch's list begins with its `parent`'s, which the
    parent counts."""
    for f in traj.failures[len(parent.failures) :] if parent is not None else traj.failures:
        s = states.setdefault(f.state, _state())
        key = "retries" if f.handled == "retry" else "catches"
        s[key] = s.get(key, 0) + 1


def _count_segments(
    traj: Any, edges: dict[int, dict[str, Any]], states: dict[str, dict[str, Any]], own: int = 0
) -> None:
    """Each segment after the first: counted on the state that started it and on the edge that entered it
    (a segment the initial state started has no edge). `own`: where the node's own path begins (a branch's
    segments before it are its parent's)."""
    starts = traj.segment_starts() if getattr(traj, "closed", ()) else ()
    entered: set[int] = set()  # path positions already counted as a rewrite of their edge
    for reason, at in starts:
        if at < own:
            continue
        s = states[traj.path[at]]
        s["segments"] = s.get("segments", 0) + 1
        by_reason = s.setdefault("segment_reasons", {})
        by_reason[reason] = by_reason.get(reason, 0) + 1
        if at > 0:
            e = edges[traj.transitions_fired[at - 1]]
            e["segments"] = e.get("segments", 0) + 1
            if at not in entered:
                entered.add(at)
                e["rewrites"] = e.get("rewrites", 0) + 1


def tree_stats(trajectories: Sequence[Any]) -> dict[str, Any]:
    """How many nodes the trees of a run produced: in all, per child machine and per forking state."""
    children: dict[str, int] = {}
    branches: dict[str, int] = {}
    nodes = [n.node for t in trajectories for n in nodes_of(t)]
    for node in nodes:
        if node.kind != "root" and node.origin is not None:
            into = children if node.kind == "child" else branches
            into[node.origin] = into.get(node.origin, 0) + 1
    return {"nodes": len(nodes), "children": children, "branches": branches}


def run_file(run_dir: str | Path, name: str, what: str) -> Path:
    """`run_dir`'s file `name` (`run_dir` is the run directory or the file itself); FileNotFoundError naming
    `what` is missing when it is not there."""
    path = Path(run_dir)
    if path.is_dir():
        path = path / name
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no {what} here; pass the directory `agentfsm run --out DIR` wrote")
    return path


def load_run_stats(run_dir: str | Path) -> dict[str, Any]:
    """The "fsm" section of a run's summary.json (`run_dir` is the run directory or the file itself)."""
    path = run_file(run_dir, "summary.json", "run summary")
    summary = json.loads(path.read_text(encoding="utf-8"))
    stats = summary.get("fsm") if isinstance(summary, dict) else None  # `[]` is JSON too
    if not isinstance(stats, dict) or "edges" not in stats:
        raise ValueError(f'{path} has no "fsm" run statistics section (written by `agentfsm run`)')
    return stats


def _ground_truth(row: Any) -> Any:
    """The row's `reward_model.ground_truth`, JSON-ready (parquet rows may hold numpy values)."""
    reward_model = row.get("reward_model") if isinstance(row, dict) else None
    truth = reward_model.get("ground_truth") if isinstance(reward_model, dict) else None
    if truth is None or isinstance(truth, (str, int, float, bool)):
        return truth
    return str(truth.tolist() if hasattr(truth, "tolist") else truth)


def _turns(seg: Any, decode: Callable[[list[int]], str | None]) -> list[dict[str, Any]]:
    """A segment's token runs as turns: role, text, mask, token count, and a model turn's weight versions."""
    ids = seg.response_ids.tolist()
    versions = seg.response_versions.tolist() if hasattr(seg, "response_versions") else []

    def turn_versions(run: Any) -> list[int] | None:
        """The distinct weight versions of a model turn's tokens, in order (one unless updated mid-turn)."""
        if run.role != "assistant" or not versions:
            return None
        return sorted(set(versions[run.start : run.end]))

    return [
        {
            "role": run.role,
            "text": decode(ids[run.start : run.end]),
            "mask": 1 if run.role == "assistant" else 0,
            "n_tokens": run.end - run.start,
            **({"weight_versions": v} if (v := turn_versions(run)) else {}),
        }
        for run in seg.runs
    ]


def _notes(traj: Any) -> dict[str, Any]:
    """The record's optional fields: a harness row's gateway session, notes and ending, failures, token check."""
    notes: dict[str, Any] = {}
    extra = getattr(traj, "extra", {})
    if extra.get("harness_session"):  # a harness row's gateway session (fsm/gateway/harness.py)
        notes["gateway_session"] = extra["harness_session"]
    if extra.get("gateway_notes"):  # what the gateway changed in a harness's requests (fsm/gateway/record.py)
        notes["gateway_notes"] = list(extra["gateway_notes"])
    if isinstance(extra.get("harness"), dict):  # how its harness ended: outcome, error, exit_code, result
        notes["harness"] = extra["harness"]
    if getattr(traj, "failures", None):  # what a state's rules handled, in order (fsm/run/failures.py)
        notes["failures"] = [f.record() for f in traj.failures]
    if getattr(traj, "token_check", None):  # --check-tokens: the first difference from a re-render
        notes["token_check"] = traj.token_check
    return notes


def trajectory_record(
    traj: Any, codec: Any = None, *, weight: float | None = None, policy: str = "default"
) -> dict[str, Any]:
    """The JSON-ready record of one finished trajectory (or one node of a tree); `codec` (fsm.families.Codec: the
    model's exact text) decodes it, and without one only token counts are kept. `weight`: each of its rows' (the
    batch's `weight` column; default: a linear trajectory's per-root share, 1 / its segments); `policy`: a linear
    trajectory's (its spec's)."""

    def decode(part: list[int]) -> str | None:
        if codec is None:
            return None
        return codec.decode(part, skip_special_tokens=False)

    turns = _turns(traj, decode)
    span = traj.weight_versions() if hasattr(traj, "weight_versions") else None
    record = {
        "index": traj.index,
        "uid": traj.uid,
        "sample": traj.sample,
        "session_id": traj.session_id,
        "termination_reason": traj.termination_reason,
        "reward_score": traj.reward_score,
        "ground_truth": _ground_truth(traj.row),
        "state_path": list(traj.path),
        "num_turns": traj.num_turns,
        "error": traj.error,
        "prompt": decode(traj.prompt_ids.tolist()),
        "prompt_tokens": len(traj.prompt_ids),
        "weight_version_min": span[0] if span else None,  # over the generated tokens
        "weight_version_max": span[1] if span else None,
        "turns": turns,
    }
    if hasattr(traj, "node"):
        record.update(tree_record(traj, 0, policy))
        record["weight"] = weight if weight is not None else 1.0 / traj.num_segments
    record.update(_notes(traj))
    if (last := tree_fields(traj, len(traj.closed))) is not None:  # the top-level row's place in its tree
        record.update(last)
    if getattr(traj, "closed", ()):
        path = traj.path  # `state`: where the segment began (the state whose action started it)
        record["segments"] = [
            {
                "index": seg.index,
                "reason": seg.reason,
                "state": path[min(seg.at, len(path) - 1)],
                "prompt": decode(seg.prompt_ids.tolist()),
                "prompt_tokens": len(seg.prompt_ids),
                "turns": _turns(seg, decode) if seg.index < len(traj.closed) else turns,
                **(tree_fields(traj, seg.index) or {}),
            }
            for seg in traj.segments
        ]
    return record


def read_records(run_dir: str | Path) -> list[dict[str, Any]]:
    """The records of a run's trajectories.jsonl (`run_dir` is the run directory or the file itself)."""
    path = run_file(run_dir, "trajectories.jsonl", "trajectories")
    records = []
    with path.open(encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(
                    f"{path}:{lineno}: not a trajectory record ({exc.msg}); is this a run's "
                    "trajectories.jsonl?"
                ) from None
            if not isinstance(record, dict):
                raise ValueError(f"{path}:{lineno}: not a trajectory record (a JSON object per line)")
            records.append(record)
    return records


def print_summary(summary: dict[str, Any], console: Any) -> None:
    """The run table: rewards, how rows ended, turns and tokens, time, tracing, routing and server faults."""
    from rich.table import Table

    n, rows = summary["trajectories"], summary.get("rows", summary["trajectories"])
    of_rows = f" ({rows} rows)" if rows != n else ""  # a tree run: every node that has a row
    table = Table(title=f"{summary['agent']}: {n} trajectories{of_rows} in {summary['wall_s']:.1f}s")
    table.add_column("metric")
    table.add_column("value", justify="right")

    def add(name: str, value: Any) -> None:
        table.add_row(name, f"{value:.3f}" if isinstance(value, float) else str(value))

    if summary["reward_mean"] is not None:
        add("reward mean", summary["reward_mean"])
        add("accuracy (reward > 0)", summary["accuracy"])
    for reason, count in summary["termination_reasons"].items():
        add(f"ended: {reason}", count)
    add("turns (mean)", summary["turns_mean"])
    add("response tokens (mean)", summary["response_tokens_mean"])
    add("model tokens / s", round(summary["model_tokens"] / max(summary["wall_s"], 1e-9)))
    add("failed rows", summary["failed"])
    add("tool errors", summary["tool_errors"])
    contained = summary.get("containment")
    if contained:
        if contained["uncontained"]:
            add("harnesses NOT contained", f"{contained['uncontained']} of {contained['rows']}: not isolated")
        else:
            add("harnesses contained", f"{contained['rows']} of {contained['rows']}")
    timing = summary["timing"]
    if timing:
        add(
            "generate s (mean / max)",
            f"{timing['agent_loop/generate_sequences/mean']:.3f} / "
            f"{timing['agent_loop/generate_sequences/max']:.3f}",
        )
        add("tool calls s (mean)", timing["agent_loop/tool_calls/mean"])
    tracing = summary.get("tracing")
    if tracing:
        add("spans exported / dropped", f"{tracing['exported']} / {tracing['dropped']}")
    router = summary.get("router")
    if router:
        totals = router.get("totals", router)
        for key in ("sticky", "new", "group", "moved", "cache_hit_rate"):
            if key in totals:
                add(f"router {key}", totals[key])
    faults = summary.get("server_faults")
    if (
        faults
    ):  # what the servers did wrong, then what it cost: each fault is retried, failed over or an error row
        for kind, count in faults["faults"].items():
            if count:
                add(f"server fault: {kind.replace('_', ' ')}", count)
        for key in ("retries", "failovers", "aborts_sent", "resumes"):
            if faults[key] or any(faults["faults"].values()):
                add(f"{key.replace('_', ' ')}", faults[key])
    console.print(table)
