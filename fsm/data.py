"""Dataset rows from .jsonl or .parquet files, in verl's dataset format.

A file that cannot be read as rows (missing, unknown type, a line that is not a JSON object) is refused,
with every problem located as `path:line:col`. A row that reads fine but cannot run (no prompt, messages of
the wrong shape) is kept: the engine fails that row alone, with an `error: bad row` reason, so one bad row
never stops a batch and none is silently dropped.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fsm.rows import normalize_record


class DataError(ValueError):
    """A data file that cannot be used. `problems` lists each one as `path:line[:col]: message`."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        shown = problems[:20] + ([f"... and {len(problems) - 20} more"] if len(problems) > 20 else [])
        super().__init__("\n".join(shown))


def load_rows(path: str | Path, *, prompt_key: str = "raw_prompt") -> list[dict[str, Any]]:
    """Rows of a `.jsonl` (one JSON object per line) or `.parquet` file, normalised as every input is
    (fsm/rows.py); the chat messages are read from `prompt_key`."""
    path = Path(path)
    if not path.is_file():
        raise DataError([f"{path}: no such data file (give a .jsonl or .parquet file with a raw_prompt column)"])
    if path.suffix == ".jsonl":
        rows = _jsonl(path)
    elif path.suffix == ".parquet":
        rows = _parquet(path)
    else:
        raise DataError([f"{path}: unsupported file type {path.suffix!r}; use .jsonl or .parquet"])
    if not rows:
        raise DataError([f"{path}: the file has no rows"])
    return [normalize_record(row, prompt_key) for row in rows]


def _jsonl(path: Path) -> list[dict[str, Any]]:
    rows, problems = [], []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                problems.append(f"{path}:{lineno}:{exc.colno}: invalid JSON: {exc.msg}")
                continue
            if not isinstance(row, dict):
                problems.append(f"{path}:{lineno}: a row must be a JSON object, got {type(row).__name__}")
                continue
            rows.append(row)
    if problems:
        raise DataError(problems)
    return rows


def _parquet(path: Path) -> list[dict[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError([f"{path}: reading parquet needs pyarrow (pip install 'agentfsm[parquet]')"]) from None
    try:
        return pq.read_table(path).to_pylist()
    except Exception as exc:  # pyarrow raises several types for corrupt files
        raise DataError([f"{path}: cannot read parquet: {exc}"]) from None
