"""The test modules whose outcome can change without the optional extras: the ones .ci/run runs again in a
fresh virtualenv with only the README's `pip install -e ".[test]"` (skips allowed, failures not).

Found from the sources, so a new test that needs an extra is picked up without a list to keep: a test module is
chosen when it imports a package that only an extra brings (pyproject's optional-dependencies past `test`), asks
for one (`extra(...)`, `importorskip`, `find_spec`), or names a file of the repository that imports one (a
harness module, or a spec or example beside it that names that module). The product's own lazy imports
(fsm/, backends/) are guarded where they are made (a one-line error naming the extra) and are not counted.
Prints the paths, one a line.
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
IMPORT_NAMES = {"openai-agents": "agents", "pyyaml": "yaml"}  # a distribution imported under another name
ASKS = re.compile(
    r"\b(?:extra|importorskip|find_spec)\(\s*(?:[\"']([\w.]+)[\"']|(\w))"
)  # a literal, or a variable
PRODUCT = ("fsm", "backends", "viz")


def extra_modules() -> set[str]:
    """The import names of what only the extras past `test` install."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    base = {_name(req) for req in extras.get("test", [])}
    names = {_name(req) for group, reqs in extras.items() if group != "test" for req in reqs} - base
    return {IMPORT_NAMES.get(n, n.replace("-", "_")) for n in names}


def _name(requirement: str) -> str:
    return re.split(r"[\[<>=!~; ]", requirement, maxsplit=1)[0].strip().lower()


def imports_of(text: str, modules: set[str], *, top_level_only: bool) -> bool:
    indent = "" if top_level_only else r"\s*"
    names = "|".join(sorted(map(re.escape, modules)))
    return re.search(rf"^{indent}(?:import|from)\s+(?:{names})\b", text, re.M) is not None


def references(path: Path) -> tuple[str, ...]:
    """How another file names `path`: its repo path, and its dotted module for a .py."""
    rel = path.relative_to(ROOT).as_posix()
    dotted = rel.removesuffix(".py").replace("/", ".")
    return (rel, dotted) if path.suffix == ".py" else (rel,)


def users_of_extras(modules: set[str]) -> set[Path]:
    """Repository files (outside tests' own modules) that import an extra, and the YAML beside them naming them."""
    found = set()
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT)
        if rel.parts[0].startswith(".") or rel.parts[0] == "tests" and rel.name.startswith("test_"):
            continue
        text = path.read_text(errors="replace")
        if imports_of(text, modules, top_level_only=rel.parts[0] in PRODUCT):
            found.add(path)
    for path in ROOT.rglob("*.yaml"):
        if path.relative_to(ROOT).parts[0].startswith("."):
            continue
        text = path.read_text(errors="replace")
        if any(ref in text for user in list(found) if user.suffix == ".py" for ref in references(user)[1:]):
            found.add(path)
    return found


def asks(text: str, modules: set[str]) -> bool:
    """The module asks for an extra's package by name (`extra("ray", ...)`, `find_spec("sglang")`), or for a
    package it names in a variable (`extra(NEEDS[name], ...)`: counted, it may be any)."""
    return any(variable or name.split(".")[0] in modules for name, variable in ASKS.findall(text))


def selected() -> list[Path]:
    modules = extra_modules()
    users = users_of_extras(modules)
    refs = {ref for user in users for ref in references(user)}
    chosen = []
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        if path.parent.name in ("verl", "verl07", "openrlhf", "skyrl", "areal"):
            continue  # run in their own virtualenvs by .ci/run
        text = path.read_text(errors="replace")
        if (
            imports_of(text, modules, top_level_only=False)
            or asks(text, modules)
            or any(r in text for r in refs)
        ):
            chosen.append(path)
    return chosen


if __name__ == "__main__":
    paths = selected()
    if not paths:
        sys.exit("extras_tests: no test module uses an optional extra: the selection is broken")
    print("\n".join(p.relative_to(ROOT).as_posix() for p in paths))
