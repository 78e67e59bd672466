"""Transcripts of finished trajectories: what the model wrote (mask 1) and what it was shown (mask 0).

`trajectory_record(traj, codec)` is the JSON line `agentfsm run` writes to trajectories.jsonl, one per
trajectory:

    {"index": 3, "uid": "calc-0-1", "sample": 1, "session_id": "...", "termination_reason": "done",
     "reward_score": 1.0, "ground_truth": "449", "state_path": ["PENDING", "GENERATING", ...], "num_turns": 4,
     "error": null,
     "prompt": "<|im_start|>system ...", "prompt_tokens": 216,
     "turns": [{"role": "assistant", "text": "<tool_call>...", "mask": 1, "n_tokens": 22},
               {"role": "template", "text": "\\n", "mask": 0, "n_tokens": 1},
               {"role": "tool", "text": "<|im_start|>user\\n<tool_response>...", "mask": 0, "n_tokens": 13}, ...]}

A trajectory whose context was rewritten (several segments, each a training row) also has `"segments"`: one
`{"index", "reason", "prompt", "prompt_tokens", "turns"}` per segment in order; the top-level `prompt` and
`turns` are then its last segment's.

A harness row (fsm/gateway/harness.py) also has `"harness"`: how its harness ended (`outcome`: returned, exit,
error, timeout, spinning, cancelled; `error`: its error or stderr tail; `exit_code`; `result`: what it returned or
printed). A row that `--check-tokens` found different from a re-render has `"token_check"`: its segment (when
there are several), the first differing token position and the text on both sides there.

`turns` are the trajectory's response token runs in order: "assistant" (the model's tokens, mask 1), "tool"
and "user" (observations, mask 0) and "template" (chat-template scaffolding the model did not generate,
mask 0), decoded with special tokens kept; `ground_truth` is the row's `reward_model.ground_truth` (None
when it has none). `render_transcript` and `show` print them, with the answer beside the ground truth.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from rich.console import Console, Group, RenderableType
from rich.rule import Rule
from rich.text import Text

ROLE_STYLES = {"assistant": "bold green", "tool": "cyan", "user": "yellow", "template": "dim"}
PROMPT_TAIL_CHARS = 400  # the prompt's end (the question); system prompts and tool schemas are long
ANSWER_CHARS = 120  # the answer and ground truth in a transcript's header
_SPECIAL = re.compile(r"<\|[^|<>]*\|>")  # chat-template tokens such as <|im_end|>


def _ground_truth(row: Any) -> Any:
    """The row's `reward_model.ground_truth`, JSON-ready (parquet rows may hold numpy values)."""
    reward_model = row.get("reward_model") if isinstance(row, dict) else None
    truth = reward_model.get("ground_truth") if isinstance(reward_model, dict) else None
    if truth is None or isinstance(truth, (str, int, float, bool)):
        return truth
    return str(truth.tolist() if hasattr(truth, "tolist") else truth)


def trajectory_record(traj: Any, codec: Any = None) -> dict[str, Any]:
    """The JSON-ready record of one finished trajectory; `codec` (fsm.families.Codec: the model's exact
    text) decodes it, and without one only token counts are kept."""

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
    extra = getattr(traj, "extra", {})
    if extra.get("harness_session"):  # a harness row's gateway session (fsm/gateway/harness.py)
        record["gateway_session"] = extra["harness_session"]
    if extra.get("gateway_notes"):  # what the gateway changed in a harness's requests (fsm/gateway/record.py)
        record["gateway_notes"] = list(extra["gateway_notes"])
    if isinstance(extra.get("harness"), dict):  # how its harness ended: outcome, error, exit_code, result
        record["harness"] = extra["harness"]
    if getattr(traj, "token_check", None):  # --check-tokens: the first difference from a re-render
        record["token_check"] = traj.token_check
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
            }
            for seg in traj.segments
        ]
    return record


def mask_ratio(record: dict[str, Any]) -> tuple[int, int]:
    """(tokens with mask 1, response tokens)."""
    turns = record.get("turns") or []
    return sum(t["n_tokens"] for t in turns if t.get("mask")), sum(t["n_tokens"] for t in turns)


def _tokens(n: int) -> str:
    return f"{n} token" if n == 1 else f"{n} tokens"


def _header(record: dict[str, Any]) -> list[tuple[str, str]]:
    """(text, style) lines describing the trajectory."""
    ones, total = mask_ratio(record)
    ratio = f"{ones}/{total} tokens mask=1 ({100 * ones / total:.1f}%)" if total else "no response tokens"
    reward = record.get("reward_score")
    reward = "-" if reward is None else f"{reward:g}"
    lines = [
        (f"trajectory {record.get('index')}  uid {record.get('uid')}  sample {record.get('sample')}", "bold"),
        ("path: " + " -> ".join(record.get("state_path") or []), ""),
        (
            f"end: {record.get('termination_reason')}   reward: {reward}   turns: {record.get('num_turns')}   {ratio}",
            "",
        ),
    ]
    answer = final_answer(record)
    if answer is not None or record.get("ground_truth") is not None:
        lines.append((f"answer: {_clip(answer)}   ground truth: {_clip(record.get('ground_truth'))}", "bold"))
    if record.get("error"):
        lines.append((f"error: {record['error']}", "bold red"))
    if harness_failure(record):
        lines.append((f"harness: {harness_failure(record)}", "bold red"))
    if record.get("token_check"):
        lines.append((f"token check: {record['token_check']}", "bold red"))
    return lines


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


def final_answer(record: dict[str, Any]) -> str | None:
    """The last non-empty line the model wrote (chat-template tokens removed); None without decoded text."""
    for turn in reversed(record.get("turns") or []):
        if turn.get("role") == "assistant" and turn.get("text") is not None:
            lines = [line.strip() for line in _SPECIAL.sub("", turn["text"]).splitlines() if line.strip()]
            if lines:
                return lines[-1]
    return None


def _clip(value: Any) -> str:
    text = "-" if value is None else str(value)
    return text if len(text) <= ANSWER_CHARS else text[: ANSWER_CHARS - 1] + "…"


def _prompt_tail(record: dict[str, Any]) -> str | None:
    prompt = record.get("prompt")
    if prompt is None:
        return None
    return prompt if len(prompt) <= PROMPT_TAIL_CHARS else "…" + prompt[-PROMPT_TAIL_CHARS:]


def render_transcript(record: dict[str, Any], color: bool = True) -> str | RenderableType:
    """One trajectory: a header (path, end, reward, mask-1 ratio), the prompt's tail, then every turn with
    its role, mask and token count. `color=False` gives plain text; `color=True` a rich renderable in
    which the model's tokens and each kind of observation have their own colour."""
    header = _header(record)
    prompt = _prompt_tail(record)
    turns = record.get("turns") or []
    earlier = (record.get("segments") or [])[:-1]
    if not color:
        out = [f"=== {header[0][0]} ==="] + [text for text, _ in header[1:]]
        for seg in earlier:
            out.append(
                f"=== segment {seg['index']} ({seg['reason']}): prompt {_tokens(seg['prompt_tokens'])}"
            )
            for t in seg["turns"]:
                out.append(f"--- {t['role']} [mask {t['mask']}] ({_tokens(t['n_tokens'])})")
                out.append(t["text"] if t.get("text") is not None else f"({_tokens(t['n_tokens'])})")
        if earlier:
            last = record["segments"][-1]
            out.append(f"=== segment {last['index']} ({last['reason']}), the last")
        if prompt is not None:
            out += [f"--- prompt ({record.get('prompt_tokens')} tokens, the end shown)", prompt]
        for t in turns:
            out.append(f"--- {t['role']} [mask {t['mask']}] ({_tokens(t['n_tokens'])})")
            out.append(t["text"] if t.get("text") is not None else f"({_tokens(t['n_tokens'])})")
        return "\n".join(out) + "\n"
    parts: list[RenderableType] = [Rule(Text(header[0][0], style="bold"), align="left")]
    parts += [Text(text, style=style) for text, style in header[1:]]
    for seg in earlier:
        parts.append(
            Text(
                f"segment {seg['index']} ({seg['reason']}): prompt {_tokens(seg['prompt_tokens'])}, "
                f"{sum(t['n_tokens'] for t in seg['turns'])} response tokens",
                style="bold magenta",
            )
        )
    if earlier:
        parts.append(Text(f"segment {record['segments'][-1]['index']}, the last:", style="bold magenta"))
    if prompt is not None:
        parts.append(
            Text(f"prompt ({record.get('prompt_tokens')} tokens, the end shown)", style="dim italic")
        )
        parts.append(Text(prompt, style="bright_black"))
    body = Text()
    for t in turns:
        style = ROLE_STYLES.get(t["role"], "magenta")
        if t["role"] != "template":
            body.append(
                f"\n[{t['role']} · mask {t['mask']} · {_tokens(t['n_tokens'])}]\n", style=f"{style} reverse"
            )
        body.append(t["text"] if t.get("text") is not None else f"({_tokens(t['n_tokens'])})", style=style)
    parts.append(body)
    return Group(*parts)


def read_records(run_dir: str | Path) -> list[dict[str, Any]]:
    """The records of a run's trajectories.jsonl (`run_dir` is the run directory or the file itself)."""
    path = Path(run_dir)
    if path.is_dir():
        path = path / "trajectories.jsonl"
    if not path.is_file():
        raise FileNotFoundError(
            f"{path}: no trajectories here; pass the directory `agentfsm run --out DIR` wrote"
        )
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


def select(
    records: Iterable[dict[str, Any]], row: int | None = None, worst: bool = False, failed: bool = False
) -> list[dict[str, Any]]:
    """`row`: only the trajectory with that index; `failed`: only those with an error, a failed harness or a
    token check that found a difference; `worst`: lowest reward first (no reward counts as lowest)."""
    chosen = [
        r
        for r in records
        if (row is None or r.get("index") == row)
        and (not failed or r.get("error") or harness_failure(r) or r.get("token_check"))
    ]
    if worst:
        chosen.sort(key=lambda r: (r.get("reward_score") is not None, r.get("reward_score") or 0.0))
    return chosen


def show(
    run_dir: str | Path,
    row: int | None = None,
    worst: bool = False,
    failed: bool = False,
    *,
    limit: int | None = None,
    color: bool | None = None,
    console: Console | None = None,
) -> int:
    """Print a run's transcripts (see `select`), at most `limit` of them; colour when printing to a terminal.
    Returns how many it printed. A `row` the run does not have raises LookupError."""
    records = read_records(run_dir)
    chosen = select(records, row=row, worst=worst, failed=failed)
    if row is not None and not chosen:
        indices = sorted({r.get("index") for r in records if isinstance(r.get("index"), int)})
        have = f"its rows are {indices[0]}..{indices[-1]}" if indices else "it has no trajectories"
        raise LookupError(f"{run_dir}: no row {row} in this run ({have})")
    console = console or Console(highlight=False)
    if color is None:
        color = console.is_terminal
    say = console.print if color else print
    if not chosen:
        say(f"no {'failed trajectories' if failed else 'trajectories'} in {run_dir}")
        return 0
    shown = chosen[:limit] if limit is not None else chosen
    try:
        for record in shown:
            if color:
                console.print(render_transcript(record, color=True))
                console.print()
            else:
                sys.stdout.write(render_transcript(record, color=False) + "\n")
        if len(shown) < len(chosen):
            say(f"(showed {len(shown)} of {len(chosen)}; --limit N shows more)")
        sys.stdout.flush()
    except BrokenPipeError:  # `agentfsm show run | head`: the reader has had enough
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
    return len(shown)
