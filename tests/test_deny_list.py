"""The import deny-list holds for the whole standard library, its private and deprecated aliases included,
checked against lists generated from the interpreter itself (sys.stdlib_module_names), not a hand-kept one.
"""

from __future__ import annotations

import importlib
import inspect
import subprocess
import sys
import warnings

import pytest

from fsm.spec.registry import DENIED_MODULES, SAFE_STDLIB, UnsafeImportError, check_import_path, resolve
from tests.conftest import REPO

STDLIB = sorted(sys.stdlib_module_names)


@pytest.mark.parametrize("name", STDLIB)
def test_every_standard_library_module_outside_the_safe_list_is_refused(name):
    top = name.split(".")[0]
    safe = top in SAFE_STDLIB
    if safe:
        check_import_path(f"{name}:anything")
    else:
        with pytest.raises(UnsafeImportError, match=r"trust: \{allow_modules: \["):
            check_import_path(f"{name}:anything")
        check_import_path(f"{name}:anything", allow=[name])  # the opt-in lifts it


def test_the_safe_list_names_real_standard_library_modules():
    assert SAFE_STDLIB <= set(sys.stdlib_module_names)
    assert not SAFE_STDLIB & DENIED_MODULES


def _public_callables(module_name: str):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        module = importlib.import_module(module_name)
    for attr, value in vars(module).items():
        if not attr.startswith("_") and callable(value) and not inspect.ismodule(value):
            yield f"{module_name}:{attr}"


# Where a safe module re-exports them, objects of these stay refused: builtins holds eval, exec and open,
# types builds functions from code objects, _thread starts threads.
ALWAYS_REFUSED_ORIGINS = {"builtins", "types", "_thread"}


@pytest.mark.parametrize("module_name", sorted(SAFE_STDLIB))
def test_everything_a_safe_module_offers_resolves(module_name):
    """Its functions may live in C accelerators (`heapq.heappush.__module__` is `_heapq`): still allowed."""
    refused = []
    for ref in _public_callables(module_name):
        try:
            obj = resolve(ref)
        except UnsafeImportError:
            module, attr = ref.split(":")
            origin = getattr(getattr(importlib.import_module(module), attr), "__module__", None)
            if origin not in ALWAYS_REFUSED_ORIGINS:
                refused.append(ref)
        else:
            assert obj is not None
    assert not refused


@pytest.mark.parametrize(
    "ref",
    [
        "distutils.spawn:spawn",
        "distutils.dir_util:remove_tree",
        "imp:load_source",
        "_socket:socket",
        "posix:system",
        "_posixsubprocess:fork_exec",
        "_io:open",
        "nt:system",
        "asyncore:dispatcher",
        "uuid:_get_command_stdout",
        "setuptools:setup",
        "pip._internal.utils.subprocess:call_subprocess",
        "_thread:start_new_thread",
        "random:_os.system",  # a safe module's own reference to a refused one
    ],
)
def test_aliases_private_and_deprecated_modules_are_refused(ref):
    with pytest.raises(UnsafeImportError):
        check_import_path(ref) if "." not in ref.split(":")[1] else resolve(ref)


SPEC = """\
name: alias_tool
extends: {base}
tools:
  - function: {ref}
    schema: {{type: function, function: {{name: run, parameters: {{type: object, properties: {{cmd: {{type: string}}}}}}}}}}
"""


@pytest.mark.slow
@pytest.mark.parametrize("ref", ["distutils.spawn:spawn", "imp:load_source", "_socket:socket"])
def test_validate_refuses_them_without_trust(tmp_path, ref):
    """Through the real `agentfsm validate --static` process: a positioned unsafe-import diagnostic, exit 2."""
    spec = tmp_path / "spec.yaml"
    spec.write_text(SPEC.format(base=REPO / "specs" / "tool_agent.yaml", ref=ref))
    proc = subprocess.run(
        [sys.executable, "-m", "fsm.cli.commands", "validate", "--static", str(spec)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and proc.stdout.count("\n") == 1, proc.stdout + proc.stderr
    assert proc.stdout.startswith(f"{spec}:4:") and "unsafe-import" in proc.stdout


# --- third-party loaders that run code (issue 27.20) -----------------------------------------------------

LOADERS = [
    "yaml:unsafe_load",
    "yaml:load",
    "yaml:unsafe_load_all",
    "torch:load",
    "torch.serialization:load",
    "torch.jit:load",
    "torch.hub:load",
    "numpy:load",
    "pandas:read_pickle",
    "dill:loads",
    "cloudpickle:loads",
    "joblib:load",
]


@pytest.mark.parametrize("ref", LOADERS)
def test_third_party_loaders_that_run_code_are_refused_unless_the_spec_opts_in(ref):
    top = ref.split(".")[0].split(":")[0]
    with pytest.raises(UnsafeImportError, match=rf"trust: \{{allow_modules: \[{top}\]\}}"):
        check_import_path(ref)
    check_import_path(ref, allow=[top])
    check_import_path("numpy:mean") and check_import_path("torch:tensor") and check_import_path(
        "yaml:safe_load"
    )


def test_a_loader_reexported_under_another_name_is_refused_where_it_was_defined():
    with pytest.raises(UnsafeImportError, match="numpy"):
        resolve("tests.fixtures.parts:read_array")
    assert resolve("tests.fixtures.parts:read_array", allow=["numpy"]) is __import__("numpy").load


def test_a_spec_naming_torch_load_as_a_tool_fails_validation(tmp_path):
    import fsm

    path = tmp_path / "spec.yaml"
    path.write_text(
        f"name: x\nextends: {REPO / 'specs' / 'tool_agent.yaml'}\ntools:\n  - function: torch:load\n"
    )
    (diag,) = fsm.validate_file(path)
    assert diag.code == "unsafe-import" and diag.line == 4, str(diag)
    path.write_text(path.read_text() + "trust: {allow_modules: [torch]}\n")
    assert all(d.code != "unsafe-import" for d in fsm.validate_file(path))
