"""The run directory `agentfsm run --out DIR` writes: batch.pt, trajectories.jsonl and summary.json, replaced
together so that DIR never holds a mix of two runs.

`write_run(out, write)` has `write(staging)` put the three files into a fresh temporary directory inside
`out` (the same filesystem, so a rename is atomic). Then it removes the previous run's three files,
summary.json first, and renames the new ones in, summary.json last, holding Ctrl-C off for those few
renames. A summary.json therefore always describes the files beside it, and a directory without one holds
no complete run. Why per-file renames rather than swapping the whole directory for the staging one: `out`
may hold other things (sglang_logs/, a rendered diagram) or be ".", which a swap would drop.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")
OUTPUT_FILES = ("batch.pt", "trajectories.jsonl", "summary.json")  # summary.json last: it vouches for the rest


class WriteInterrupted(Exception):
    """Ctrl-C arrived during `write_run`; `committed`: whether the new run had replaced the old one by then
    (if not, `out` holds what it held before)."""

    def __init__(self, committed: bool):
        super().__init__("committed" if committed else "not committed")
        self.committed = committed


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
        with ctrl_c_held():
            for name in reversed(OUTPUT_FILES):  # summary.json first: without it, nothing here vouches
                (out / name).unlink(missing_ok=True)
            for name in OUTPUT_FILES:
                os.replace(staging / name, out / name)
            committed = True
        return result
    except KeyboardInterrupt:
        raise WriteInterrupted(committed) from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
