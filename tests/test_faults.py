"""The fault suite: nothing a tool, a server, a spec or a data file does can hang, kill or poison a run.

Each section feeds one kind of hostile input to the engine and asserts two things: the answer (a clear,
positioned, one-line error, or the run going on without the faulty part), and the cost of giving it.
Anything that could go wrong without bound runs in a child process under an address-space and CPU-time
limit, with a wall-clock timeout, so a regression fails its test instead of hanging or swapping the
machine that runs the suite.

This file holds the hostile specs and data files. The suite's other parts sit beside the code they test:
- tests/test_tool_faults.py: tools that hang (sync and async), busy-loop, raise BaseException, return 50 MB,
  or die in `isolation: process`;
- tests/test_server_faults.py: 503s, dropped and reset connections, malformed and wrong-schema 200s, hung
  `/generate` (deadline, `/abort_request`, failover), a server killed mid-batch, the watchdog, and the
  summary's fault counts against what a proxy injected;
- tests/test_aborts.py: waiting-queue and mid-generation aborts resumed to the uninterrupted run's tokens;
- tests/test_cli.py: bad flag values, atomic outputs under interrupts, `--max-error-rate`.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

import fsm
from fsm.spec.registry import ImportPathError, UnsafeImportError, resolve

REPO = Path(__file__).resolve().parents[1]
SPECS = REPO / "specs"

# ==========================================================================================================
# Hostile specs and data
#
# A spec is read by `agentfsm validate` in editors and CI before anyone trusts it; a data file is read by
# `agentfsm run`. Each case below was a traceback, a silent acceptance, or unbounded time or memory (a
# 447-byte alias bomb, `extends: /dev/zero` at 500 MB/s, 2 M keys for 420 s). Each must now be one line,
# `file:line:col: code: message` (data: `file:line[:col]: message`), costing under CPU_LIMIT_S of CPU beyond
# what validating a trivial spec costs and under RSS_LIMIT_MB of peak memory for the whole process. CPU
# time, not wall time, is what is asserted: on a shared machine wall time measures the neighbours (wall
# time is bounded only by the hang guard). The CLI cases run `python -m fsm.cli.commands validate` itself.
# ==========================================================================================================

CPU_LIMIT_S = 1.0
RSS_LIMIT_MB = 100
HANG_GUARD_S = 60
DIAGNOSTIC = re.compile(
    r"^(?P<path>[^:]+):(?P<line>\d+):(?P<col>\d+): (?P<code>[a-z][a-z-]*): (?P<message>.+)$"
)
DATA_PROBLEM = re.compile(r"^(?P<path>[^:]+):(?P<line>\d+)(?::(?P<col>\d+))?: (?P<message>.+)$")


@dataclass
class Cost:
    """What one child process answered and what it cost (from wait4: this child alone)."""

    rc: int
    out: str
    err: str
    wall_s: float
    cpu_s: float
    rss_mb: float


# Runs the command given after it and writes what wait4 says of that child alone (its rusage) to a file.
# A child forked from pytest would count pytest's pages (torch included) in its peak RSS until it execs;
# forked from this small launcher, the peak it reports is the command's own (or the launcher's ~12 MB).
LAUNCHER = """
import json, os, resource, subprocess, sys, time
report, guard, argv = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
def limits():  # a runaway case dies instead of taking the machine
    resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))
    resource.setrlimit(resource.RLIMIT_CPU, (guard, guard))
start = time.perf_counter()
proc = subprocess.Popen(argv, preexec_fn=limits)
while (done := os.wait4(proc.pid, os.WNOHANG))[0] == 0:
    if time.perf_counter() - start > guard:
        proc.kill()
        done = os.wait4(proc.pid, 0)
        break
    time.sleep(0.005)
usage = done[2]
json.dump({"rc": os.waitstatus_to_exitcode(done[1]), "wall_s": time.perf_counter() - start,
           "cpu_s": usage.ru_utime + usage.ru_stime, "rss_mb": usage.ru_maxrss / 1024}, open(report, "w"))
"""


def run_child(argv: list[str], env: dict[str, str] | None = None) -> Cost:
    child_env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    child_env.update(env or {})
    with tempfile.TemporaryDirectory() as d:
        report = Path(d) / "cost.json"
        done = subprocess.run(
            [sys.executable, "-c", LAUNCHER, str(report), str(HANG_GUARD_S), *argv],
            cwd=REPO,
            env=child_env,
            capture_output=True,
            timeout=HANG_GUARD_S + 30,
        )
        cost = json.loads(report.read_text())
    return Cost(out=done.stdout.decode(errors="replace"), err=done.stderr.decode(errors="replace"), **cost)


def validate(*args: str | Path, env: dict[str, str] | None = None) -> Cost:
    return run_child([sys.executable, "-m", "fsm.cli.commands", "validate", *map(str, args)], env)


@pytest.fixture(scope="module")
def baseline(tmp_path_factory) -> Cost:
    """Validating a trivial spec: interpreter start and imports, which every case pays too."""
    path = tmp_path_factory.mktemp("baseline") / "ok.yaml"
    path.write_text("name: ok\ninitial: TERMINATED\nstates:\n  TERMINATED: {final: true}\n")
    cost = validate(path)
    assert cost.rc == 0 and cost.out.strip() == f"{path}: ok", cost
    return cost


def assert_cheap(cost: Cost, baseline: Cost) -> None:
    assert cost.cpu_s - baseline.cpu_s < CPU_LIMIT_S, (
        f"{cost.cpu_s:.2f} s of CPU (baseline {baseline.cpu_s:.2f})"
    )
    assert cost.rss_mb < RSS_LIMIT_MB, f"peak RSS {cost.rss_mb:.0f} MB"
    assert cost.wall_s < HANG_GUARD_S, "hung"


def assert_one_diagnostic(cost: Cost, path: Path, code: str) -> re.Match:
    assert "Traceback" not in cost.err and cost.err == "", cost.err[-2000:]
    lines = cost.out.splitlines()
    assert len(lines) == 1, f"expected one line, got {len(lines)}:\n{cost.out[:2000]}"
    m = DIAGNOSTIC.match(lines[0])
    assert m, f"not 'file:line:col: code: message': {lines[0]}"
    assert m["code"] == code, lines[0]
    assert m["path"] == str(path) or m["message"].endswith(f"(reached from {path})"), lines[0]
    assert int(m["line"]) >= 1 and int(m["col"]) >= 1 and cost.rc == 2
    return m


# --- hostile spec files: each writes one into a directory and returns (path, expected code) -------------


def alias_bomb(d: Path) -> tuple[Path, str]:
    """The classic billion laughs: 9 levels of 9 aliases, ~500 bytes, 3.9e9 nodes once expanded."""
    lines = ["name: bomb", 'a0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    lines += [f"a{i}: &a{i} [{','.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 10)]
    path = d / "bomb.yaml"
    path.write_text("\n".join([*lines, "states: *a9"]) + "\n")
    return path, "too-large"


def huge_spec(d: Path) -> tuple[Path, str]:
    """2 M keys (24 MB): refused after reading the first 128 KiB."""
    path = d / "huge.yaml"
    with path.open("w") as f:
        f.write("name: huge\nstates:\n  TERMINATED: {final: true}\nlimits:\n")
        f.writelines(f"  k{i}: {i}\n" for i in range(2_000_000))
    return path, "too-large"


def deep_brackets(d: Path) -> tuple[Path, str]:
    """100k unclosed '[' (100 KB, under the byte limit): refused at the 65th, before the scanner's
    look-ahead (quadratic in open brackets) gets going."""
    path = d / "deep.yaml"
    path.write_text("name: deep\nstates: " + "[" * 100_000 + "\n")
    return path, "too-deep"


def deep_json(d: Path) -> tuple[Path, str]:
    """JSON (which is YAML) nested 100k deep: 600 KB, refused by size first."""
    path = d / "deep.json.yaml"
    path.write_text('{"name": "x", "states": ' + '{"a": ' * 100_000 + "1" + "}" * 100_000 + "}\n")
    return path, "too-large"


def deep_block(d: Path) -> tuple[Path, str]:
    """Block mappings 500 deep (the indentation keeps it under the byte limit)."""
    path = d / "deep_block.yaml"
    path.write_text("name: x\nstates:\n" + "".join(" " * (i + 1) + "a:\n" for i in range(500)))
    return path, "too-deep"


def tagged_sequence(d: Path) -> tuple[Path, str]:
    path = d / "tag_seq.yaml"
    path.write_text('name: x\nimports: !!python/object/apply:os.system ["echo owned"]\nstates: {}\n')
    return path, "yaml-tag"


def tagged_sequence_plain(d: Path) -> tuple[Path, str]:
    path = d / "tag_foo.yaml"
    path.write_text("name: x\nimports: !foo [1]\nstates: {}\n")
    return path, "yaml-tag"


def tagged_mapping(d: Path) -> tuple[Path, str]:
    path = d / "tag_map.yaml"
    path.write_text("name: x\nstates: !foo {TERMINATED: {final: true}}\n")
    return path, "yaml-tag"


def not_utf8(d: Path) -> tuple[Path, str]:
    path = d / "latin1.yaml"
    path.write_bytes("name: x\ndescription: café\nstates: {}\n".encode("latin-1"))
    return path, "encoding"


def extends_dev_zero(d: Path) -> tuple[Path, str]:
    path = d / "zero.yaml"
    path.write_text("name: x\nextends: /dev/zero\n")
    return path, "extends"


def extends_chain(d: Path) -> tuple[Path, str]:
    """40 files, each extending the next: refused at the 16th."""
    for i in range(40):
        (d / f"chain{i}.yaml").write_text(f"name: c{i}\nextends: chain{i + 1}.yaml\n")
    return d / "chain0.yaml", "extends"


def recursive_alias(d: Path) -> tuple[Path, str]:
    path = d / "recursive.yaml"
    path.write_text("name: x\nstates: &s {TERMINATED: *s}\n")
    return path, "alias"


def control_character(d: Path) -> tuple[Path, str]:
    path = d / "ctrl.yaml"
    path.write_text("name: x\ndescription: a\x00b\nstates: {}\n")
    return path, "yaml-syntax"


def unclosed_brace(d: Path) -> tuple[Path, str]:
    path = d / "unclosed.yaml"
    path.write_text("name: x\nstates: {TERMINATED: {final: true}\n")
    return path, "yaml-syntax"


HOSTILE_SPECS: list[Callable[[Path], tuple[Path, str]]] = [
    alias_bomb,
    huge_spec,
    deep_brackets,
    deep_json,
    deep_block,
    tagged_sequence,
    tagged_sequence_plain,
    tagged_mapping,
    not_utf8,
    extends_dev_zero,
    extends_chain,
    recursive_alias,
    control_character,
    unclosed_brace,
]


@pytest.mark.slow
@pytest.mark.parametrize("make", HOSTILE_SPECS, ids=[f.__name__ for f in HOSTILE_SPECS])
def test_hostile_spec_is_one_positioned_line_quickly(make, tmp_path, baseline):
    path, code = make(tmp_path)
    cost = validate(path)
    diag = assert_one_diagnostic(cost, path, code)
    assert_cheap(cost, baseline)
    if make is unclosed_brace:  # the '{' that opened the problem, not the end of the file
        assert (diag["line"], diag["col"]) == ("2", "9")
    if make is extends_dev_zero:
        assert (diag["line"], diag["col"]) == ("2", "10")


def test_hostile_specs_in_process_too():
    """The library path (fsm.validate_file) answers the same diagnostics, without a traceback."""
    with tempfile.TemporaryDirectory() as d:
        for make in (
            alias_bomb,
            tagged_sequence,
            tagged_mapping,
            not_utf8,
            extends_dev_zero,
            recursive_alias,
        ):
            path, code = make(Path(d))
            (diag,) = fsm.validate_file(path)
            assert diag.code == code and diag.path == str(path), diag


# --- a spec is code: --static imports nothing; the deny-list; the opt-in -----------------------------------

SENTINEL = """
import os
open(os.environ["SENTINEL_FILE"], "w").write("imported")
"""


def test_static_validate_imports_nothing(tmp_path, baseline):
    """`imports:` and every import path run under full validation; under --static none does."""
    (tmp_path / "sentinel_mod.py").write_text(SENTINEL)
    marker = tmp_path / "imported"
    spec = tmp_path / "imports.yaml"
    spec.write_text(
        f"name: x\nextends: {SPECS / 'single_turn.yaml'}\nimports: [sentinel_mod, this]\ntrust: {{allow_modules: [this]}}\n"
        "reward: {function: 'sentinel_mod:score'}\n"
        "states:\n  GENERATING:\n    action: generate\n    next:\n"
        "      - {to: TERMINATED, when: registered_by_sentinel}\n      - {to: TERMINATED}\n"
    )
    env = {"PYTHONPATH": str(tmp_path), "SENTINEL_FILE": str(marker)}
    cost = validate("--static", spec, env=env)
    assert cost.rc == 0 and cost.out.strip() == f"{spec}: ok", cost
    assert not marker.exists(), "--static imported the spec's module"
    assert "Zen of Python" not in cost.out  # `import this` prints it
    assert_cheap(cost, baseline)

    cost = validate(spec, env=env)  # full validation does import: the sentinel works
    assert marker.exists() and "Zen of Python" in cost.out
    assert "unknown guard 'registered_by_sentinel'" in cost.out and "no attribute 'score'" in cost.out


OS_SYSTEM_TOOL = """name: x
extends: {base}
tools:
  - function: os:system
    schema: {{type: function, function: {{name: sh, parameters: {{type: object, properties: {{command: {{type: string}}}}}}}}}}
"""


@pytest.mark.parametrize("mode", [(), ("--static",)], ids=["full", "static"])
def test_os_system_tool_is_refused(tmp_path, baseline, mode):
    spec = tmp_path / "shell.yaml"
    spec.write_text(OS_SYSTEM_TOOL.format(base=SPECS / "tool_agent.yaml"))
    cost = validate(*mode, spec)
    diag = assert_one_diagnostic(cost, spec, "unsafe-import")
    assert diag["line"] == "4" and "trust: {allow_modules: [os]}" in diag["message"]
    assert_cheap(cost, baseline)


@pytest.mark.parametrize("mode", [(), ("--static",)], ids=["full", "static"])
def test_trust_opt_in_is_accepted(tmp_path, baseline, mode):
    spec = tmp_path / "shell.yaml"
    spec.write_text(OS_SYSTEM_TOOL.format(base=SPECS / "tool_agent.yaml") + "trust: {allow_modules: [os]}\n")
    cost = validate(*mode, spec)
    assert cost.rc == 0 and cost.out.strip() == f"{spec}: ok", cost


def test_opt_in_compiles_and_is_per_module():
    with tempfile.TemporaryDirectory() as d:
        spec = Path(d) / "shell.yaml"
        spec.write_text(
            OS_SYSTEM_TOOL.format(base=SPECS / "tool_agent.yaml") + "trust: {allow_modules: [os]}\n"
        )
        agent = fsm.compile_spec(spec)
        assert list(agent.tools.by_name) == ["sh"]  # compiled; nothing called it
        spec.write_text(
            OS_SYSTEM_TOOL.format(base=SPECS / "tool_agent.yaml") + "trust: {allow_modules: [sys]}\n"
        )
        with pytest.raises(fsm.SpecError, match="unsafe-import"):
            fsm.compile_spec(spec)


@pytest.mark.parametrize(
    "ref",
    [
        "os:system",
        "os.path:join",
        "subprocess:run",
        "builtins:eval",
        "importlib:import_module",
        "pickle:loads",
        "socket:create_connection",
        "shutil:rmtree",
        "ctypes:CDLL",
        "runpy:run_path",
        "tests.fixtures.parts:asyncio.create_subprocess_shell",  # a deny-listed module met on the way
    ],
)
def test_deny_list_refuses(ref):
    with pytest.raises(UnsafeImportError):
        resolve(ref)


def test_deny_list_allows_what_the_spec_opts_in_to_and_nothing_else():
    assert resolve("os:system", ["os"]) is os.system  # its __module__ is posix: opting in to os covers it
    assert resolve("os.path:join", ["os.path"]) is os.path.join
    with pytest.raises(UnsafeImportError, match=r"allow_modules: \[os\]"):
        resolve("os:system", ["os.path"])
    with pytest.raises(ImportPathError, match="dunder"):
        resolve("tests.fixtures.parts:__builtins__")
    assert resolve("json:dumps") is not None and resolve("specs.calculator:calculator") is not None


# --- hostile data files: fsm.data.files.load_rows -------------------------------------------------------------

LOAD_ROWS = """
import sys
from fsm.data.files import DataError, load_rows
try:
    rows = load_rows(sys.argv[1])
except DataError as exc:
    print(exc)
    sys.exit(1)
print(f"{len(rows)} rows")
"""


def load_rows_child(path: Path) -> Cost:
    return run_child([sys.executable, "-c", LOAD_ROWS, str(path)])


@pytest.fixture(scope="module")
def rows_baseline(tmp_path_factory) -> Cost:
    path = tmp_path_factory.mktemp("rows") / "ok.jsonl"
    path.write_text('{"raw_prompt": "hi"}\n')
    cost = load_rows_child(path)
    assert cost.rc == 0 and cost.out.strip() == "1 rows", cost
    return cost


GOOD_ROW = b'{"raw_prompt": "hi"}\n'
HOSTILE_ROWS = {
    "not_utf8": (GOOD_ROW + b'{"raw_prompt": "caf\xe9"}\n' + GOOD_ROW, 2),
    "nested_100k": (GOOD_ROW * 2 + b"[" * 100_000 + b"]" * 100_000 + b"\n", 3),
    "huge_line": (GOOD_ROW + b'{"raw_prompt": "' + b"x" * (20 << 20) + b'"}\n' + GOOD_ROW, 2),
    "huge_integer": (b'{"raw_prompt": "hi", "n": ' + b"9" * 100_000 + b"}\n", 1),
}


@pytest.mark.parametrize("case", list(HOSTILE_ROWS))
def test_hostile_rows_are_a_data_error_naming_the_line(case, tmp_path, rows_baseline):
    content, lineno = HOSTILE_ROWS[case]
    path = tmp_path / f"{case}.jsonl"
    path.write_bytes(content)
    cost = load_rows_child(path)
    assert cost.rc == 1 and cost.err == "", cost.err[-2000:]
    lines = cost.out.splitlines()
    assert len(lines) == 1, cost.out[:2000]
    m = DATA_PROBLEM.match(lines[0])
    assert m and m["path"] == str(path) and int(m["line"]) == lineno, lines[0]
    assert cost.cpu_s - rows_baseline.cpu_s < CPU_LIMIT_S, f"{cost.cpu_s:.2f} s of CPU"
    assert cost.rss_mb < RSS_LIMIT_MB, f"peak RSS {cost.rss_mb:.0f} MB"
