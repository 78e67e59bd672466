"""How far a run reaches into the code (issue 47; the numbers are in docs/architecture.md).

    python -m bench.crossed run [AGENTFSM ARGS...]   # files one `agentfsm run` crosses (default: the main job)
    python -m bench.crossed path                     # modules on the path of a batch through generate_sequences

`run` profiles one `agentfsm run` in this process, every thread: a file is crossed when a function of it is
called outside an import (module and class bodies, and what they call while importing, are not counted);
it prints them with their count per package.
`path` follows a two-row `generate_sequences` of the embedded model down to each `Runner.drive`, across the
engine's loop thread (`fsm.run.local.submit`) and its tasks (`create_task`), and names the steps that go
back up the stages of tests/test_architecture.py. Both print JSON.
"""

from __future__ import annotations

import asyncio
import asyncio.base_events
import contextlib
import json
import sys
import threading
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
ROOTS = tuple(str(REPO / p) + "/" for p in ("fsm", "backends", "viz"))
STAGES = [
    "families",
    "spec",
    "data",
    "tools",
    "run",
    "output",
    "telemetry",
    "api",
    "gateway",
    "adapters",
    "cli",
]


def _rel(filename: str) -> str:
    return str(Path(filename).relative_to(REPO))


def crossed(argv: list[str]) -> dict[str, Any]:
    """The files whose functions one `agentfsm ARGV` calls, outside imports."""
    files: set[str] = set()
    importing: dict[int, int] = {}  # thread -> module bodies running

    def profile(frame: Any, event: str, arg: Any) -> None:
        code = frame.f_code
        if code.co_name == "<module>" and event in ("call", "return"):
            me = threading.get_ident()
            importing[me] = importing.get(me, 0) + (1 if event == "call" else -1)
        elif event == "call" and code.co_flags & 1 and code.co_filename.startswith(ROOTS):  # 1: a function
            if not importing.get(threading.get_ident()):
                files.add(_rel(code.co_filename))

    from fsm.cli.commands import main

    sys.setprofile(profile)
    threading.setprofile(profile)
    try:
        with contextlib.redirect_stdout(sys.stderr):  # the run's own printout; stdout is the JSON
            rc = main(argv)
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    packages: dict[str, int] = {}
    for name in files:  # fsm's by stage package (fsm/api.py is one), backends and viz whole
        package = (
            "/".join(name.removesuffix(".py").split("/")[:2])
            if name.startswith("fsm/")
            else name.split("/")[0]
        )
        packages[package] = packages.get(package, 0) + 1
    return {
        "rc": rc,
        "files": len(files),
        "by_package": dict(sorted(packages.items())),
        "crossed": sorted(files),
    }


def batch_path() -> dict[str, Any]:
    """The modules between `generate_sequences` and each `Runner.drive`, and the steps back up a stage."""
    import fsm.run.local as loopthread

    made_by: dict[int, list[str]] = {}  # id(coroutine) -> the files on the stack that started it

    def stack(skip: int) -> list[str]:
        frame: Any = sys._getframe(skip)
        files: list[str] = []
        while frame is not None:
            files.append(frame.f_code.co_filename)
            frame = frame.f_back
        task = None
        try:
            task = asyncio.current_task()
        except RuntimeError:  # no loop in this thread
            pass
        before = made_by.get(id(task.get_coro()), []) if task is not None else []
        return before + [f for f in reversed(files) if f.startswith(ROOTS)]

    submit, create_task = loopthread.submit, asyncio.base_events.BaseEventLoop.create_task

    def traced_submit(coro: Any, loop: Any, *args: Any, **kwargs: Any) -> Any:
        made_by[id(coro)] = stack(2)
        return submit(coro, loop, *args, **kwargs)

    def traced_create_task(self: Any, coro: Any, **kwargs: Any) -> Any:
        made_by.setdefault(id(coro), stack(2))
        return create_task(self, coro, **kwargs)

    paths: set[tuple[str, ...]] = set()

    def profile(frame: Any, event: str, arg: Any) -> None:
        if (
            event == "call"
            and frame.f_code.co_name == "drive"
            and frame.f_code.co_filename.endswith("run/runtime.py")
        ):
            steps: list[str] = []
            for f in stack(1):
                if not steps or steps[-1] != _rel(f):
                    steps.append(_rel(f))
            paths.add(tuple(steps))

    from fsm import RolloutEngine

    loopthread.submit = traced_submit
    asyncio.base_events.BaseEventLoop.create_task = traced_create_task  # type: ignore[method-assign]
    engine = RolloutEngine(str(REPO / "specs" / "calculator.yaml"))
    row = {"raw_prompt": [{"role": "user", "content": "What is 2 + 3?"}], "extra_info": {"answer": "5"}}
    sys.setprofile(profile)
    threading.setprofile(profile)
    try:
        engine.generate_sequences([row, row])
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
        loopthread.submit = submit
        asyncio.base_events.BaseEventLoop.create_task = create_task  # type: ignore[method-assign]
        engine.close()

    def stage(module: str) -> int | None:
        parts = module.removesuffix(".py").split("/")
        return STAGES.index(parts[1]) if parts[0] == "fsm" and parts[1] in STAGES else None

    out = []
    for steps in sorted(paths):
        up = [
            f"{a} -> {b}"
            for a, b in zip(steps, steps[1:])
            if (sa := stage(a)) is not None and (sb := stage(b)) is not None and sb > sa
        ]
        out.append({"modules": len(set(steps)), "path": " -> ".join(steps), "back_up": up})
    return {"paths": out}


if __name__ == "__main__":
    what, rest = (sys.argv[1:2] or ["run"])[0], sys.argv[2:]
    if what == "path":
        result = batch_path()
    else:
        result = crossed(rest or ["run", "specs/calculator.yaml", "--out", "runs/crossed", "-q"])
    print(json.dumps(result, indent=1))
