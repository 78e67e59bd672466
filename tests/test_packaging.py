"""The wheel installs only names that are ours: fsm (the benchmarks inside it, fsm/_bundled/bench), backends, viz
and specs; no top-level `bench` or `examples` that another distribution's would collide with."""

import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_wheel_top_level_names(tmp_path):
    # built offline from the tracked files (a copy: the build leaves build/ and *.egg-info behind)
    files = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    src = tmp_path / "src"
    with tarfile.open(tmp_path / "src.tar", "w") as tar:
        for name in filter(None, files):
            path = ROOT / name.decode()
            if path.is_file():
                tar.add(path, arcname=name.decode())
    with tarfile.open(tmp_path / "src.tar") as tar:
        tar.extractall(src, filter="data")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(src),
        ],
        check=True,
        capture_output=True,
        timeout=600,
    )
    (wheel,) = tmp_path.glob("agentfsm-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top == {"fsm", "backends", "viz", "specs"}, top
    # `agentfsm bench` finds these (fsm/cli/bundled.py); the spec assets travel too
    assert "fsm/_bundled/bench/__init__.py" in names and "fsm/_bundled/bench/engine.py" in names
    assert "specs/calculator.yaml" in names and "fsm/cli/bundled.py" in names


def test_bench_found_from_a_checkout():
    from fsm.cli.bundled import bench_module

    module = bench_module("router")
    assert Path(module.__file__).resolve().parent == ROOT / "bench"
