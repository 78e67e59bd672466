"""The run directory `agentfsm run --out DIR` writes: batch.pt, trajectories.jsonl and summary.json, replaced
together so that DIR never holds a mix of two runs; and the summary those files get and the table it prints.

`write_run(out, write)` has `write(staging)` put the three files into a fresh temporary directory inside
`out` (the same filesystem, so a rename is atomic). Then it removes the previous run's three files,
summary.json first, and renames the new ones in, summary.json last, holding Ctrl-C off for those few
renames. A summary.json therefore always describes the files beside it, and a directory without one holds
no complete run. Why per-file renames rather than swapping the whole directory for the staging one: `out`
may hold other things (sglang_logs/, a rendered diagram) or be ".", which a swap would drop.

trajectories.jsonl holds one record per finished trajectory or tree node, `trajectory_record(traj, codec)`
(its format: docs/contracts.md), read back by `read_records` (`agentfsm show`, viz/transcript.py, the CLI).
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
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from fsm.output.stats import run_file, run_stats
from fsm.run.tree import nodes_of, tree_fields, tree_record

if TYPE_CHECKING:
    from fsm.run.agent import CompiledAgent

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


def _ground_truth(row: Any) -> Any:
    """The row's `reward_model.ground_truth`, JSON-ready (parquet rows may hold numpy values)."""
    reward_model = row.get("reward_model") if isinstance(row, dict) else None
    truth = reward_model.get("ground_truth") if isinstance(reward_model, dict) else None
    if truth is None or isinstance(truth, (str, int, float, bool)):
        return truth
    return str(truth.tolist() if hasattr(truth, "tolist") else truth)


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

    def runs(seg: Any) -> list[dict[str, Any]]:
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

    turns = runs(traj)
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
    extra = getattr(traj, "extra", {})
    if extra.get("harness_session"):  # a harness row's gateway session (fsm/gateway/harness.py)
        record["gateway_session"] = extra["harness_session"]
    if extra.get("gateway_notes"):  # what the gateway changed in a harness's requests (fsm/gateway/record.py)
        record["gateway_notes"] = list(extra["gateway_notes"])
    if isinstance(extra.get("harness"), dict):  # how its harness ended: outcome, error, exit_code, result
        record["harness"] = extra["harness"]
    if getattr(traj, "failures", None):  # what a state's rules handled, in order (fsm/run/failures.py)
        record["failures"] = [f.record() for f in traj.failures]
    if getattr(traj, "token_check", None):  # --check-tokens: the first difference from a re-render
        record["token_check"] = traj.token_check
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
                "turns": runs(seg) if seg.index < len(traj.closed) else turns,
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


def write_outputs(
    out: Path,
    agent: CompiledAgent,
    trajs: list,
    batch: Any,
    codec: Any,
    wall: float,
    router_stats: Any,
    tracer: Any,
) -> dict[str, Any]:
    """batch.pt, trajectories.jsonl and summary.json of a run, into `out`; the summary back."""
    from fsm.output.batch import fault_summary, save_batch, summarize, tree_weights

    files = (
        {policy_batch_file(p): b for p, b in batch.items()}
        if isinstance(batch, dict)
        else {"batch.pt": batch}
    )
    for name, one in files.items():
        try:
            # loadable with torch.load's weights_only=True (fsm/output/batch.py)
            save_batch(one, out / name)
        except RuntimeError as exc:  # torch's writer reports a full disk as a RuntimeError
            raise OSError(f"{name}: {str(exc).splitlines()[0] if str(exc) else 'write failed'}") from exc
    if isinstance(batch, dict):
        batch = next(iter(batch.values()))  # the root policy's: its timing goes in the summary
    weights = tree_weights(trajs, agent.spec.tree.weight, agent.spec.policy)
    with (out / "trajectories.jsonl").open("w") as f:
        for root in trajs:  # a tree's nodes follow its root, one record each (docs/trees.md)
            for traj in nodes_of(root):
                record = trajectory_record(
                    traj, codec, weight=weights.get(id(traj), 0.0), policy=agent.spec.policy
                )
                f.write(json_text(record, ensure_ascii=False) + "\n")
    summary = summarize(trajs)
    summary.update(
        spec=str(agent.path),
        agent=agent.name,
        spec_hash=agent.hash,
        wall_s=round(wall, 3),
        timing=batch.meta_info["timing"],
        router=router_stats,
    )
    summary["server_faults"] = fault_summary(trajs, router_stats)
    summary["fsm"] = run_stats(agent, trajs)
    if (contained := containment(trajs)) is not None:
        summary["containment"] = contained
    if tracer is not None:
        summary["tracing"] = tracer.stats()
    (out / "summary.json").write_text(json_text(summary, indent=2, default=str) + "\n")
    return summary


def containment(trajs: list) -> dict[str, Any] | None:
    """Whether the run's command harnesses were contained (fsm/gateway/reaper.py: each in a PID namespace with its
    own /proc, its row's `extra.harness.contained`); None without command harnesses. A run with one that was not is
    not isolated (a harness could read another's session key in /proc and outlive its row): the summary and the run
    table say so, never a clean run."""
    said = [
        h["contained"] for t in trajs if isinstance(h := t.extra.get("harness"), dict) and "contained" in h
    ]
    if not said:
        return None
    why = [s.removeprefix("no: ") for s in said if s != "pid+proc"]  # the reaper's word for contained
    return {
        "rows": len(said),
        "contained": len(said) - len(why),
        "uncontained": len(why),
        "why": sorted(set(why)),
    }


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
