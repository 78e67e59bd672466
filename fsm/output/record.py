"""The record format of a run's trajectories.jsonl (docs/contracts.md): what `agentfsm run` writes for each
finished trajectory (fsm/output/rundir.py), and how it is read back (`agentfsm show`, viz/transcript.py, the CLI's
outcome lines). `trajectory_record(traj, codec)` is one JSON line, one per trajectory.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fsm.output.stats import run_file
from fsm.run.tree import tree_fields, tree_record  # the batch's tree columns, as one record's fields


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
