"""Transcripts of finished trajectories: what the model wrote (mask 1) and what it was shown (mask 0), drawn from
the records of a run's trajectories.jsonl (their format: fsm/output/rundir.py). `render_transcript` and `show`
print them, with the answer beside the ground truth.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from rich.console import Console, Group, RenderableType
from rich.rule import Rule
from rich.text import Text

from fsm.output.rundir import harness_failure, read_records

ROLE_STYLES = {"assistant": "bold green", "tool": "cyan", "user": "yellow", "template": "dim"}
PROMPT_TAIL_CHARS = 400  # the prompt's end (the question); system prompts and tool schemas are long
ANSWER_CHARS = 120  # the answer and ground truth in a transcript's header
_SPECIAL = re.compile(r"<\|[^|<>]*\|>")  # chat-template tokens such as <|im_end|>


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
    if record.get("node") not in (None, "0") or record.get("node_kind") not in (None, "root"):
        lines.insert(
            1,
            (
                f"node {record['node']} ({record.get('node_kind')} of {record.get('parent')}, policy "
                f"{record.get('policy')}, depth {record.get('depth')}, weight {record.get('weight', 0):.3g}, "
                f"shares {record.get('shared_prefix', {}).get('length', 0)} tokens with its parent)",
                "bold cyan",
            ),
        )
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


def tree_outline(records: list[dict[str, Any]], tree: str) -> str | None:
    """The nodes of one tree as an indented outline (one line a node: kind, policy, end, reward); None for a
    tree of one node (a linear trajectory)."""
    nodes = [r for r in records if r.get("tree") == tree]
    if len(nodes) < 2:
        return None
    lines = [f"tree {tree}: {len(nodes)} nodes"]
    for r in sorted(nodes, key=lambda r: [int(x) for x in str(r.get("node", "0")).split(".")]):
        depth = str(r.get("node", "0")).count(".")
        reward = r.get("reward_score")
        lines.append(
            f"{'  ' * (depth + 1)}{r.get('node')} {r.get('node_kind')} [{r.get('policy')}] "
            f"{r.get('termination_reason')}  reward {'-' if reward is None else f'{reward:g}'}  "
            f"weight {r.get('weight', 0):.3g}"
        )
    return "\n".join(lines)


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
        indices = sorted({r["index"] for r in records if isinstance(r.get("index"), int)})
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
            outline = tree_outline(records, record["tree"]) if record.get("node") == "0" else None
            if outline is not None:
                say(outline)
            if color:
                console.print(render_transcript(record, color=True))
                console.print()
            else:
                sys.stdout.write(f"{render_transcript(record, color=False)}\n")  # plain text: a str
        if len(shown) < len(chosen):
            say(f"(showed {len(shown)} of {len(chosen)}; --limit N shows more)")
        sys.stdout.flush()
    except BrokenPipeError:  # `agentfsm show run | head`: the reader has had enough
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
    return len(shown)
