"""`--num-prompts N` of a large data file reads N rows, not the file: a 1e6-row .jsonl with `--num-prompts 4`
parsed every row (1.76 GB, over a minute) before taking four (issue 50). Now reading stops once the rows asked
for are read: the rest of a .jsonl is never parsed, and a parquet file is read batch by batch within its row
groups. Each case is a real process over a generated million-row file, its peak memory read from the kernel.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from backends.scripted import echo_backend
from tests.conftest import ASSETS, REPO, SPECS
from tests.test_cli import _ThreadServer

ROWS = 1_000_000


def _line(k: int) -> bytes:
    row = {
        "raw_prompt": f"What is {k} + {k}? Think step by step.",
        "uid": f"u{k}",
        "extra_info": {"n": "x" * 80},
    }
    return (json.dumps(row) + "\n").encode()


@pytest.fixture(scope="module")
def big_jsonl(tmp_path_factory):
    """A million rows (~190 MB), written in blocks; row k's uid is u{k}. Removed after the module: the suite
    shares the CI machine's disk with virtualenvs still being built."""
    path = tmp_path_factory.mktemp("data") / "big.jsonl"
    with path.open("wb") as f:
        for start in range(0, ROWS, 10_000):
            f.write(b"".join(_line(k) for k in range(start, start + 10_000)))
    yield path
    path.unlink()


def _peak(argv: list[str], tmp_path) -> tuple[int, int, str]:
    """Run `argv` to its end: (exit code, peak RSS in MB, stderr). The peak is the child's own VmHWM, read while
    it runs (a high-water mark, so the last read holds it): its ru_maxrss would start from this test process's,
    which exec does not reset."""
    peak_kb = 0
    with (tmp_path / "stderr").open("w+") as err:
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=err, cwd=REPO)
        deadline = time.monotonic() + 600  # generous: the machine is shared
        while proc.poll() is None and time.monotonic() < deadline:
            with contextlib.suppress(OSError, IndexError, ValueError):  # gone, or a zombie's status
                status = Path(f"/proc/{proc.pid}/status").read_text()
                peak_kb = max(peak_kb, int(status.split("VmHWM:")[1].split()[0]))
            time.sleep(0.05)
        proc.kill()
        proc.wait()
        err.seek(0)
        return proc.returncode, peak_kb // 1024, err.read()


def test_four_prompts_of_a_million_row_jsonl_read_four_rows(big_jsonl, tmp_path):
    """A real `agentfsm run --num-prompts 4`: its four rows are the file's first four, and the process peaks
    where a run of four rows does (measured: 0.4 GB; 2.2 GB when every row was parsed)."""
    server = _ThreadServer(echo_backend())
    out = tmp_path / "out"
    try:
        argv = [sys.executable, "-m", "fsm.cli.commands", "run", str(SPECS / "single_turn.yaml"), "--data"]
        argv += [str(big_jsonl), "--num-prompts", "4", "--server", server.url, "--tokenizer", str(ASSETS)]
        rc, peak_mb, err = _peak([*argv, "--out", str(out), "-q"], tmp_path)
    finally:
        server.close()
    assert rc == 0, err
    uids = [json.loads(line)["uid"] for line in (out / "trajectories.jsonl").read_text().splitlines()]
    assert sorted(uids) == ["u0", "u1", "u2", "u3"]
    assert peak_mb < 1200, f"peak RSS {peak_mb} MB for four rows"


def test_four_rows_of_a_million_row_parquet_read_one_batch(big_jsonl, tmp_path):
    """load_rows(limit=4) of a parquet file of many row groups stops in the first (0.12 GB against 2.0 GB)."""
    pytest.importorskip("pyarrow")
    import pyarrow.json as pj
    import pyarrow.parquet as pq

    path = tmp_path / "big.parquet"
    pq.write_table(pj.read_json(big_jsonl), path, row_group_size=20_000)
    code = (
        f"from fsm.data.files import load_rows; print([r['uid'] for r in load_rows({str(path)!r}, limit=4)])"
    )
    rc, peak_mb, err = _peak([sys.executable, "-c", code], tmp_path)
    assert rc == 0 and err == "", err
    assert peak_mb < 600, f"peak RSS {peak_mb} MB for four rows"
