"""The layering rules of the code base, checked on the source (nothing is imported).

- no import cycles among the project's modules, counting every import: module level, under
  TYPE_CHECKING, and inside functions (a lazy import hides a cycle from Python, not from a reader);
- `fsm` imports a concrete backend (anything in `backends` but the protocol and retry policy,
  backends/base.py) only in its composition modules: fsm/api.py, fsm/cli/commands.py (and
  fsm/cli/launch.py, the servers a run launches; fsm/cli/bundled.py, bench and dev-server),
  fsm/adapters/verl.py and the trainer adapters beside it (fsm/adapters/);
- `backends` never imports `fsm`, and no engine or backend module imports `bench`.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("fsm", "backends", "viz", "bench", "specs")
COMPOSITION = {
    "fsm.api",
    "fsm.cli.commands",
    "fsm.cli.launch",  # the servers `run` launches (commands.py's, split out)
    "fsm.cli.bundled",  # `bench` and `dev-server` (commands.py's, split out)
    "fsm.adapters.verl",
    "fsm.adapters.trl",
    "fsm.adapters.openrlhf",
    "fsm.adapters.skyrl",
    "fsm.adapters.areal",
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {
        _module_name(p): p for pkg in PACKAGES if (ROOT / pkg).is_dir() for p in (ROOT / pkg).rglob("*.py")
    }


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Project modules `name` imports anywhere in its source (`from a import b` counts a.b if a module)."""
    found: set[str] = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    [*package.split(".")[: len(package.split(".")) - node.level + 1], base]
                ).strip(".")
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, set(modules)) for name, path in modules.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle, as the list of modules along it, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt.startswith(node + "."):  # a package importing its own submodules is no cycle
                continue
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def _parents(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Each module's imports, with `pkg.mod` standing for the package `pkg` too (a module imports its
    package's __init__ on import, so a package that imports its own modules is no cycle)."""
    return {name: {t for t in targets if not name.startswith(t + ".")} for name, targets in graph.items()}


def test_no_import_cycles(graph):
    cycle = _cycle(_parents(graph))
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_one():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_only_composition_modules_import_concrete_backends(graph):
    offenders = {
        name: sorted(
            t for t in targets if t.startswith("backends") and t not in ("backends", "backends.base")
        )
        for name, targets in graph.items()
        if name.startswith("fsm") and name not in COMPOSITION
    }
    assert not {k: v for k, v in offenders.items() if v}


# The tiny model's release check runs it through the engine, as users see it; a script, imported by nothing.
SCRIPTS = {"backends.tiny.evaluate"}


def test_backends_never_import_fsm_and_nothing_imports_bench(graph):
    assert not {
        n: sorted(t for t in ts if t.startswith("fsm"))
        for n, ts in graph.items()
        if n.startswith("backends") and n not in SCRIPTS and any(t.startswith("fsm") for t in ts)
    }
    assert not {n for n, ts in graph.items() if SCRIPTS & ts}
    engine = [n for n in graph if n.split(".")[0] in ("fsm", "backends", "viz") and n != "fsm.cli.commands"]
    assert not {
        n: sorted(t for t in graph[n] if t.startswith("bench"))
        for n in engine
        if any(t.startswith("bench") for t in graph[n])
    }


def test_viz_only_draws(graph):
    """A run's results (summary.json's statistics among them) are made in fsm/output; viz draws them and only the
    CLI's render and show commands (fsm/cli/views.py) import it."""
    assert not {
        n: sorted(t for t in ts if t.startswith("viz"))
        for n, ts in graph.items()
        if n.startswith("fsm") and n != "fsm.cli.views" and any(t.startswith("viz") for t in ts)
    }


def test_no_cli_function_is_over_80_lines():
    """The command line is read one command at a time (fsm/cli/args.py: one function per command's flags)."""
    long = [
        f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for path in sorted((ROOT / "fsm" / "cli").glob("*.py"))
        for node in ast.walk(ast.parse(path.read_text(), str(path)))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and (node.end_lineno or node.lineno) - node.lineno + 1 > 80
    ]
    assert not long, long


def test_every_package_is_in_the_wheel():
    """pyproject.toml lists its packages by hand: a package folder missing there is missing from a non-editable
    install (`pip install .`), where its imports fail."""
    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    installed_as = {folder.replace("/", "."): name for name, folder in config.get("package-dir", {}).items()}
    found = {_module_name(p) for pkg in PACKAGES for p in (ROOT / pkg).rglob("__init__.py")}
    found = {installed_as.get(name, name) for name in found}  # bench/ installs as fsm._bundled.bench
    assert found - listed == set(), "add these to [tool.setuptools] packages in pyproject.toml"


# fsm's packages in the order of a run's stages: each may import only those before it (fsm/*/__init__.py say
# so in words). The chat codecs and parsers (families) are at the bottom; the composition (api, adapters, cli) on top.
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


def _stage(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "fsm" or len(parts) < 2:
        return None
    return parts[1] if parts[1] in STAGES else None


def test_fsm_packages_import_only_earlier_stages(graph):
    late = {
        f"{name} -> {target}"
        for name, targets in graph.items()
        if (stage := _stage(name))
        for target in targets
        if (other := _stage(target)) and STAGES.index(other) > STAGES.index(stage)
    }
    assert not late, "a stage imports a later one: " + ", ".join(sorted(late))


def test_every_fsm_module_belongs_to_a_stage():
    loose = sorted(p.name for p in (ROOT / "fsm").glob("*.py"))
    assert loose == ["__init__.py", "api.py", "verl_adapter.py"], (
        "put new modules in the package of their stage"
    )


def test_every_logger_is_in_the_agentfsm_tree():
    """One logger tree: `logging.getLogger("agentfsm")` configures every message the engine logs."""
    stray = []
    for name, path in _modules().items():
        if name.split(".")[0] not in ("fsm", "backends", "viz"):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "getLogger":
                arg = node.args[0] if node.args else None
                if not (isinstance(arg, ast.Constant) and str(arg.value).startswith("agentfsm.")):
                    stray.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not stray, stray
