"""A trajectory's token layout: its training rows (`Segment`: one per context rewrite) and the runs of response
tokens by origin (`TokenRuns`), in compact arrays, since 10,000 trajectories may be in flight at once
(fsm/run/trajectory.py holds the rest of a trajectory's state)."""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class TokenRun:
    """A run of response tokens with one origin, for transcripts and spans: response_ids[start:end]. (Not a
    `Segment`, which is a whole training row, nor a codec's pieces of text between added tokens.)"""

    role: str  # "assistant" (mask 1), "tool" / "user" (observations), "template" (scaffolding, mask 0)
    start: int
    end: int


_ROLE_CODES: dict[str, int] = {"assistant": 0, "tool": 1, "user": 2, "template": 3}
_ROLE_NAMES: list[str] = list(_ROLE_CODES)


def _role_code(role: str) -> int:
    code = _ROLE_CODES.get(role)
    if code is None:  # a role of a user action's own: coded once per process
        code = _ROLE_CODES[role] = len(_ROLE_NAMES)
        _ROLE_NAMES.append(role)
    return code


class TokenRuns:
    """A response's token runs as one array of (role code, start, end): a list of TokenRun objects costs ~60
    bytes a run, and a tool-calling trajectory holds a dozen or more. Reads give TokenRun records."""

    __slots__ = ("_flat",)

    def __init__(self, runs: Iterable[TokenRun] = ()):
        self._flat = array("i")
        for run in runs:
            self.add(run.role, run.start, run.end)

    def add(self, role: str, start: int, end: int) -> None:
        self._flat.extend((_role_code(role), start, end))

    def append(self, run: TokenRun) -> None:
        self.add(run.role, run.start, run.end)

    def clear(self) -> None:
        del self._flat[:]

    def __len__(self) -> int:
        return len(self._flat) // 3

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        n = len(self._flat) // 3
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError("token run index out of range")
        f = self._flat
        return TokenRun(_ROLE_NAMES[f[3 * i]], f[3 * i + 1], f[3 * i + 2])

    def __iter__(self) -> Iterator[TokenRun]:
        f, names = self._flat, _ROLE_NAMES
        return (TokenRun(names[f[k]], f[k + 1], f[k + 2]) for k in range(0, len(f), 3))

    def __reversed__(self) -> Iterator[TokenRun]:
        f, names = self._flat, _ROLE_NAMES
        return (TokenRun(names[f[k]], f[k + 1], f[k + 2]) for k in range(len(f) - 3, -1, -3))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, TokenRuns):
            return self._flat == other._flat
        if isinstance(other, Sequence):
            return list(self) == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"TokenRuns({list(self)!r})"

    def tokens_since(self, mark: int) -> tuple[int, int]:
        """(model tokens, other tokens) in the runs from index `mark` on."""
        f = self._flat
        model = other = 0
        for k in range(3 * mark, len(f), 3):
            if f[k] == 0:
                model += f[k + 2] - f[k + 1]
            else:
                other += f[k + 2] - f[k + 1]
        return model, other

    def last(self, role: str) -> TokenRun | None:
        """The last run of `role`, or None."""
        code, f = _ROLE_CODES.get(role), self._flat
        for k in range(len(f) - 3, -1, -3):
            if f[k] == code:
                return TokenRun(role, f[k + 1], f[k + 2])
        return None


def _expand_versions(runs: array, n: int) -> array:
    """Per-token weight versions of `n` tokens from their runs [start, version, start, version...]."""
    out = array("i")
    for k in range(0, len(runs), 2):
        end = runs[k + 2] if k + 2 < len(runs) else n
        out.extend(array("i", (runs[k + 1],)) * (end - runs[k]))
    return out


@dataclass(slots=True, eq=False)
class Segment:
    """One training row of a trajectory: a prompt, then everything appended to it until the next rewrite.

    `messages` is its conversation: the structured messages its prompt renders (the first `prompt_messages`),
    then the model turns and observations appended in it, so `--check-tokens` compares each segment with the
    template's render of its own conversation. `turn_rewards` are those of the model turns it holds, at
    positions in its own response.
    """

    index: int
    reason: str  # why it began: "prompt" (the first), "template", "summary", "rewrite" (window, function, after a summary)
    prompt_ids: array
    response_ids: array
    response_mask: array
    response_logprobs: array
    version_runs: array  # [start, version, ...] as Trajectory._version_runs
    runs: TokenRuns
    messages: list[dict[str, Any]]
    prompt_messages: int
    turns: int  # model turns in it
    turn_rewards: list[list[Any]]
    logprobs_missing: bool = False
    at: int = 0  # where in the trajectory's `path` it began: the state whose action started it

    def __post_init__(self) -> None:
        if not isinstance(self.runs, TokenRuns):  # a snapshot writes the runs as a list of records
            self.runs = TokenRuns(self.runs)

    @property
    def response_versions(self) -> array:
        return _expand_versions(self.version_runs, len(self.response_ids))

    def context_ids(self) -> list[int]:
        return self.prompt_ids.tolist() + self.response_ids.tolist()


_FIRST = ("prompt", 0, 0, 0)  # the first segment's `segment_start`, shared
_FIRSTS: dict[int, tuple[str, int, int, int]] = {}


def first_segment(prompt_messages: int) -> tuple[str, int, int, int]:
    """The first segment's `segment_start` for a prompt of that many messages: one shared tuple per count, so
    a one-segment trajectory allocates nothing for it."""
    start = _FIRSTS.get(prompt_messages)
    if start is None:
        start = _FIRSTS[prompt_messages] = ("prompt", prompt_messages, 0, 0)
    return start
