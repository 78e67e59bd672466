"""Dataset rows from .jsonl or .parquet files (verl's dataset columns), with errors that name the row."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class DataError(Exception):
    """A data file that cannot be used; the message names the file (and line) and what to do."""


def load_rows(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a .jsonl (one JSON object per line) or .parquet file. Each needs `raw_prompt` messages."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"{path}: no such data file (give a .jsonl or .parquet file with a raw_prompt column)")
    if path.suffix == ".parquet":
        rows = _parquet(path)
    elif path.suffix in (".jsonl", ".json"):
        rows = _jsonl(path)
    else:
        raise DataError(f"{path}: unknown data format {path.suffix!r}; use .jsonl or .parquet")
    if not rows:
        raise DataError(f"{path}: the file has no rows")
    return rows


def _jsonl(path: Path) -> list[dict[str, Any]]:
    rows = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{path}:{lineno}: not valid JSON ({exc.msg} at column {exc.colno})") from None
            if not isinstance(row, dict):
                raise DataError(f"{path}:{lineno}: each line must be a JSON object, got {type(row).__name__}")
            rows.append(row)
    return rows


def _parquet(path: Path) -> list[dict[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{path}: reading parquet needs pyarrow (pip install 'agentfsm[parquet]')") from None
    try:
        table = pq.read_table(path)
    except Exception as exc:  # pyarrow raises several types for corrupt files
        raise DataError(f"{path}: cannot read parquet: {exc}") from None
    return table.to_pylist()
