"""Agent traffic recorded from a run: the model requests of a run directory's journal as `bench fleet`'s calls.

Per model request: the session (the trajectory), its group (the row's uid: a GRPO group's samples share it),
its turn, the prompt tokens sent (the segment's prompt and every response token before the turn), the tokens
generated, and the time the trajectory spent between that answer and its next request (tools, interactions,
rewrites): the closed-loop replay of bench/fleet.py waits that long. The times are the driver's own state
entries (`Trajectory.path_times`), so a run on the embedded model records the tool latencies it had.

    python -m bench.traffic RUN_DIR > trace.jsonl     # then: agentfsm bench fleet --trace trace.jsonl
    agentfsm bench fleet --trace RUN_DIR              # the same, read straight from the run directory
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from fsm.run.fold import rebuild
from fsm.run.journal import JOURNAL, records
from fsm.run.trajectory import Trajectory
from fsm.spec.loader import load_spec


@dataclass(frozen=True, slots=True)
class Call:
    """One recorded model request of an agent's trajectory."""

    session: str
    group: str | None
    turn: int
    prompt_tokens: int  # the whole context sent
    new_tokens: int  # tokens generated
    tool_s: float  # tool latency after this answer, before the session's next request


def calls_of_run(out: str | Path) -> list[Call]:
    """The finished trajectories' model requests, in the order the run submitted them. A run directory
    without a journal, or one whose spec is gone, is a ValueError of one line."""
    path = Path(out) / JOURNAL
    if not path.is_file():
        raise ValueError(f"{out}: no {JOURNAL} (a run directory of `agentfsm run` holds one)")
    rebuilt = rebuild(records(path))
    spec_path = rebuilt.identity.get("spec")
    if not spec_path or not Path(spec_path).is_file():
        raise ValueError(f"{path}: its spec {spec_path!r} is not there to tell which states call the model")
    spec = load_spec(spec_path).spec
    generating = frozenset(name for name, st in spec.states.items() if st.action == "generate")
    calls: list[Call] = []
    for sid, traj in rebuilt.trajs.items():
        if sid in rebuilt.done:
            calls += _calls(traj, generating)
    return calls


def _calls(traj: Trajectory, generating: frozenset[str]) -> list[Call]:
    turns = list(_turns(traj))
    waits = _waits(traj, generating, len(turns))
    return [
        Call(traj.session_id, traj.uid, k, prompt, new, waits[k]) for k, (prompt, new) in enumerate(turns)
    ]


def _turns(traj: Trajectory) -> Iterator[tuple[int, int]]:
    """(prompt tokens, new tokens) per model turn, segment by segment; a turn split in runs (an aborted turn
    continued) is one request's worth of tokens, as the engine sent it again."""
    for seg in traj.segments:
        prompt = len(seg.prompt_ids)
        start = end = None
        for run in seg.runs:
            if run.role == "assistant" and end == run.start:
                end = run.end
                continue
            if start is not None and end is not None:
                yield prompt + start, end - start
            start, end = (run.start, run.end) if run.role == "assistant" else (None, None)
        if start is not None and end is not None:
            yield prompt + start, end - start


def _waits(traj: Trajectory, generating: frozenset[str], turns: int) -> list[float]:
    """Seconds from leaving each model turn's state to entering the next one (0 after the last)."""
    path, times = traj.path, traj.path_times
    at = [k for k, state in enumerate(path) if state in generating and k + 1 < len(times)]
    waits = [max(times[b] - times[a + 1], 0.0) for a, b in zip(at, at[1:], strict=False)]
    waits += [0.0] * (turns - len(waits))
    return [round(w, 6) for w in waits[:turns]]


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print("usage: python -m bench.traffic RUN_DIR > trace.jsonl", file=sys.stderr)
        return 2
    try:
        calls = calls_of_run(args[0])
    except ValueError as exc:
        print(f"bench traffic: {exc}", file=sys.stderr)
        return 1
    for call in calls:
        print(json.dumps(dataclasses.asdict(call)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
