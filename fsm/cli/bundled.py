"""Where `agentfsm bench` finds the benchmark code (bench/).

bench/ sits beside fsm/ in a checkout. A wheel carries it inside fsm (fsm/_bundled/bench, pyproject.toml's
package-dir), never as a top-level `bench` in site-packages, where another distribution's `bench` would
collide. Its modules import each other and name their tools as `bench.*`, so the folder that holds it goes
first on sys.path for the bench command's process (and, through PYTHONPATH, the client processes it starts).
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path
from types import ModuleType

FSM_DIR = Path(__file__).resolve().parents[1]
PLACES = (FSM_DIR / "_bundled", FSM_DIR.parent)  # an installed wheel's copy, then a checkout's bench/


def bench_module(name: str) -> ModuleType:
    """`bench.<name>` from the installed copy or the checkout (`async` is a keyword: no plain import)."""
    for folder in PLACES:
        if (folder / "bench" / "__init__.py").is_file():
            where = str(folder)
            if where not in sys.path:
                sys.path.insert(0, where)
            paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
            if where not in paths:
                os.environ["PYTHONPATH"] = os.pathsep.join([where, *filter(None, paths)])
            break
    return importlib.import_module(f"bench.{name}")
