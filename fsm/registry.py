"""Names the YAML can use: registries of guards and actions, and `module:attr` import paths.

XState-style: the spec names behaviour, Python implements it. A user registers a guard with
`@fsm.guard("name")` (or an action with `@fsm.action("name")`) in a module the spec lists under
`imports:`, or references a callable directly by import path.

A spec is code: its import paths run when it is compiled, and a tool's arguments come from the model. So
import paths into the standard library's process, file-system, network and interpreter modules are
refused unless the spec opts in (`trust: {allow_modules: [os]}`): a guard-rail against a careless or
model-suggested `function: os:system`, not a sandbox (any other module can do the same things).
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable, Iterable
from types import ModuleType
from typing import Any

GUARDS: dict[str, Callable[..., Any]] = {}  # name -> factory(param, limits) -> predicate(traj)
ACTIONS: dict[str, Callable[..., Any]] = {}  # name -> async action(ctx, traj)


# Standard-library modules a spec may not name unless it opts in. Each can, given arguments, run a process,
# read or write a file, reach the network, or turn data into running code; a tool's arguments are chosen
# by the model. A module is refused with its submodules (`os` covers `os.path`). Third-party and your own
# modules are not listed: they are what a spec is for, and they run with your rights.
UNSAFE_MODULES = frozenset({
    # processes, signals and the OS
    "os", "posix", "nt", "subprocess", "_posixsubprocess", "pty", "signal", "multiprocessing", "concurrent",
    "asyncio", "resource", "fcntl", "termios", "_thread", "msvcrt", "winreg", "_winapi",
    # files
    "io", "_io", "pathlib", "shutil", "tempfile", "glob", "fileinput", "linecache", "codecs", "mmap",
    "zipfile", "tarfile", "gzip", "bz2", "lzma", "sqlite3", "dbm", "shelve", "filecmp", "py_compile",
    "compileall",
    # the network
    "socket", "ssl", "select", "selectors", "http", "urllib", "ftplib", "smtplib", "poplib", "imaplib",
    "telnetlib", "xmlrpc", "socketserver", "webbrowser",
    # the interpreter: imports, code as data, debuggers and profilers that run a string
    "sys", "builtins", "importlib", "zipimport", "runpy", "code", "codeop", "ctypes", "_ctypes", "gc",
    "pickle", "_pickle", "marshal", "pdb", "bdb", "timeit", "trace", "profile", "cProfile", "pydoc",
    "doctest", "site", "ensurepip", "venv", "atexit", "faulthandler", "logging.config",
})  # fmt: skip
# C modules behind public ones: `os.system.__module__` is "posix"; opting in to "os" covers them.
_PUBLIC = {"posix": "os", "nt": "os", "_io": "io", "_pickle": "pickle", "_ctypes": "ctypes",
           "_posixsubprocess": "subprocess", "_winapi": "subprocess"}  # fmt: skip
_DOTTED = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*")


class ImportPathError(Exception):
    """An import path that is malformed or cannot be resolved. `code` is its diagnostic code."""

    code = "import"


class UnsafeImportError(ImportPathError):
    """An import path into a module of UNSAFE_MODULES that the spec did not opt in to."""

    code = "unsafe-import"


def is_import_path(ref: str) -> bool:
    return ":" in ref


def unsafe_module(module: str, allow: Iterable[str] = ()) -> str | None:
    """The deny-listed module (or package) that `module` is or lies in, unless `allow` names it."""
    parts = module.split(".")
    prefixes = [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
    denied = next((p for p in prefixes if p in UNSAFE_MODULES), None)
    if denied is None or any(p in allow for p in (*prefixes, _PUBLIC.get(denied))):
        return None
    return _PUBLIC.get(denied, denied)


def check_module(module: str, allow: Iterable[str] = (), ref: str | None = None) -> None:
    """Form and deny-list only; imports nothing. Raises ImportPathError / UnsafeImportError."""
    if not _DOTTED.fullmatch(module):
        raise ImportPathError(f"{module!r} is not a module name of the form 'package.module'")
    denied = unsafe_module(module, allow)
    if denied is not None:
        named = ref or module
        subject = repr(denied) if named == denied else f"{named!r} uses {denied!r}, which"
        raise UnsafeImportError(
            f"{subject} can run processes, touch files or the network, or run code, with arguments a model "
            f"may choose; if this spec means it, opt in at its top level: `trust: {{allow_modules: [{denied}]}}`"
        )


def check_import_path(ref: str, allow: Iterable[str] = ()) -> tuple[str, str]:
    """`package.module:attr.sub` -> (module, attr), checked for form and the deny-list; imports nothing."""
    module_name, _, attr = ref.partition(":")
    if not _DOTTED.fullmatch(module_name) or not _DOTTED.fullmatch(attr):
        raise ImportPathError(f"{ref!r} is not an import path of the form 'package.module:name'")
    if any(part.startswith("__") for part in attr.split(".")):
        raise ImportPathError(f"{ref!r} names a dunder attribute; an import path names a module's own objects")
    check_module(module_name, allow, ref)
    return module_name, attr


def import_module(module: str, allow: Iterable[str] = ()) -> ModuleType:
    """Import a module a spec lists under `imports:` (this runs its code). Raises ImportPathError."""
    check_module(module, allow)
    try:
        return importlib.import_module(module)
    except Exception as exc:  # a user module may fail with anything
        raise ImportPathError(f"cannot import module {module!r}: {type(exc).__name__}: {exc}") from None


def resolve(ref: str, allow: Iterable[str] = ()) -> Any:
    """`package.module:attr.sub` -> the object. Raises ImportPathError with a readable reason.

    The deny-list applies to the path as written, to every module met on the way (`mine:os.system`) and
    to the module the object was defined in (`mine:system` after `from os import system`).
    """
    allow = tuple(allow)
    module_name, attr = check_import_path(ref, allow)
    obj: Any = import_module(module_name, allow)
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ImportPathError(f"module {module_name!r} has no attribute {attr!r}") from None
        if isinstance(obj, ModuleType):
            check_module(obj.__name__, allow, ref)
    origin = getattr(obj, "__module__", None)
    if isinstance(origin, str) and _DOTTED.fullmatch(origin):
        check_module(origin, allow, ref)
    return obj


def guard(name: str) -> Callable[[Callable[..., bool]], Callable[..., bool]]:
    """Register a user guard `fn(traj) -> bool` (or `fn(traj, param)`) under `name`."""

    def register(fn: Callable[..., bool]) -> Callable[..., bool]:
        GUARDS[name] = _user_guard_factory(fn)
        return fn

    return register


def action(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register a user action `async fn(ctx, traj)` under `name`."""

    def register(fn: Callable[..., Any]) -> Callable[..., Any]:
        ACTIONS[name] = fn
        return fn

    return register


def _user_guard_factory(fn: Callable[..., bool]) -> Callable[..., Callable[[Any], bool]]:
    def factory(param: Any, limits: Any) -> Callable[[Any], bool]:
        if param is None:
            return fn
        if isinstance(param, dict):
            return lambda traj: fn(traj, **param)
        return lambda traj: fn(traj, param)

    return factory
