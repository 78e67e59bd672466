"""Dataset rows from .jsonl or .parquet files, in verl's dataset format.

A file that cannot be read as rows (missing, unknown type, a line that is not a JSON object, not UTF-8,
nested past Python's recursion limit, or longer than MAX_LINE_BYTES) is refused, with every problem located
as `path:line:col`; reading stops after MAX_PROBLEMS of them, so a binary file fails fast. Asked for the first
`limit` rows (`--num-prompts`), reading stops once they are read (the rest is never parsed nor checked). A row
that reads but cannot run is kept, to fail alone (fsm/data/rows.py).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from fsm.data.rows import normalize_record

MAX_LINE_BYTES = 16 * 1024 * 1024  # one row: a long-context prompt, even inline images, fits
MAX_PROBLEMS = 100
PARQUET_BATCH = 4096  # rows converted to Python at a time


class DataError(ValueError):
    """A data file that cannot be used. `problems` lists each one as `path:line[:col]: message`."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        shown = problems[:20] + ([f"... and {len(problems) - 20} more"] if len(problems) > 20 else [])
        super().__init__("\n".join(shown))


def load_rows(
    path: str | Path, *, prompt_key: str = "raw_prompt", limit: int | None = None
) -> list[dict[str, Any]]:
    """Rows of a `.jsonl` (one JSON object per line) or `.parquet` file, normalised as every input is
    (fsm/data/rows.py); the chat messages are read from `prompt_key`. `limit`: the first rows only, the rest
    never read."""
    path = Path(path)
    if not path.is_file():
        raise DataError(
            [f"{path}: no such data file (give a .jsonl or .parquet file with a raw_prompt column)"]
        )
    if path.suffix == ".jsonl":
        rows = _jsonl(path, limit)
    elif path.suffix == ".parquet":
        rows = _parquet(path, limit)
    else:
        raise DataError([f"{path}: unsupported file type {path.suffix!r}; use .jsonl or .parquet"])
    if not rows:
        raise DataError([f"{path}: the file has no rows"])
    return [SourcedRow(normalize_record(row, prompt_key), f"{path}:{where}") for where, row in rows]


class SourcedRow(dict[str, Any]):
    """A row with where it was read (`path:line` of a .jsonl file, `path:row N` of a parquet file), so a message
    about the row can name the line to fix (fsm/run/runtime.py). Otherwise a plain dict."""

    def __init__(self, row: dict[str, Any], source: str):
        super().__init__(row)
        self.source = source


def _jsonl(path: Path, limit: int | None) -> list[tuple[int | str, dict[str, Any]]]:
    rows: list[tuple[int | str, dict[str, Any]]] = []
    problems: list[str] = []
    with path.open("rb") as f:
        for lineno, raw in enumerate(_lines(f), 1):
            at = f"{path}:{lineno}"
            if limit is not None and len(rows) >= limit:
                break
            if len(problems) >= MAX_PROBLEMS:
                problems.append(f"{at}: stopped reading after {MAX_PROBLEMS} problems")
                break
            if raw is None:
                problems.append(f"{at}: line longer than {MAX_LINE_BYTES // 2**20} MiB; one row per line")
                continue
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                col = len(raw[: exc.start].decode("utf-8", "replace")) + 1
                problems.append(f"{at}:{col}: not UTF-8: byte 0x{raw[exc.start]:02x}; save the file as UTF-8")
                continue
            if not line.strip():
                continue
            try:
                row = json.loads(line.rstrip("\r\n"))  # the line break is no part of a string
            except json.JSONDecodeError as exc:
                problems.append(f"{at}:{exc.colno}: invalid JSON: {_json_problem(exc, line)}")
                continue
            except RecursionError:
                problems.append(f"{at}: JSON nested too deeply to read")
                continue
            except ValueError as exc:  # e.g. an integer of more than 4300 digits
                problems.append(f"{at}: invalid JSON: {exc}")
                continue
            if not isinstance(row, dict):
                problems.append(f"{at}: a row must be a JSON object, got {type(row).__name__}")
                continue
            rows.append((lineno, row))
    if problems:
        raise DataError(problems)
    return rows


def _json_problem(exc: json.JSONDecodeError, line: str) -> str:
    """json's message, whole: some end in " at", the position being in the exception's fields."""
    if exc.msg.startswith("Invalid control character") and exc.pos < len(line):
        char = line[exc.pos]
        return f"a raw control character U+{ord(char):04X} inside a string; JSON needs it escaped ({json.dumps(char)})"
    return exc.msg[: -len(" at")] + " here" if exc.msg.endswith(" at") else exc.msg  # "here": path:line:col


def _lines(f: IO[bytes]) -> Iterator[bytes | None]:
    """The file's lines, each read MAX_LINE_BYTES at most at a time: None for a longer one (skipped)."""
    while line := f.readline(MAX_LINE_BYTES + 1):
        if len(line) > MAX_LINE_BYTES and not line.endswith(b"\n"):
            while (rest := f.readline(1 << 20)) and not rest.endswith(b"\n"):
                pass
            yield None
        else:
            yield line


def _parquet(path: Path, limit: int | None) -> list[tuple[int | str, dict[str, Any]]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(
            [f"{path}: reading parquet needs pyarrow (pip install 'agentfsm[parquet]')"]
        ) from None
    rows: list[dict[str, Any]] = []
    try:
        with pq.ParquetFile(path) as f:  # batch by batch, within row groups: stops at `limit` rows
            for batch in f.iter_batches(batch_size=min(limit or PARQUET_BATCH, PARQUET_BATCH)):
                rows += batch.to_pylist()[: None if limit is None else limit - len(rows)]
                if limit is not None and len(rows) >= limit:
                    break
    except Exception as exc:  # pyarrow raises several types for corrupt files
        raise DataError([f"{path}: cannot read parquet: {exc}"]) from None
    return [(f"row {k}", row) for k, row in enumerate(rows, 1)]
