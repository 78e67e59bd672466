"""Names the YAML can use: registries of guards and actions (`@fsm.guard("name")`, `@fsm.action("name")` in a
module the spec lists under `imports:`) and `module:attr` import paths. XState-style: the spec names
behaviour, Python implements it.

A spec is code: its import paths run when it is compiled, and a tool's arguments come from the model. So the
standard library but SAFE_STDLIB, and the loaders that run code hidden in their input (CODE_LOADERS), are
refused unless the spec opts in: a guard-rail against a careless or model-suggested `function: os:system`,
not a sandbox (any third-party module can do the same things).

Guards are pure, synchronous predicates over a trajectory: a name, `{name: param}`, or `{all: [...]}` /
`{any: [...]}` / `{not: ...}`, compiled once per spec into one closure (`compile_guard`), so nothing is
parsed or looked up per trajectory.
"""

from __future__ import annotations

import importlib
import inspect
import re
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from types import ModuleType
from typing import Any

from fsm.spec.model import LimitsSpec

GUARDS: dict[str, Callable[..., Any]] = {}  # name -> factory(param, limits) -> predicate(traj)
ACTIONS: dict[str, Callable[..., Any]] = {}  # name -> async action(ctx, traj)


# What a spec may name without opting in: its own and third-party modules, and of the standard library only
# these, which compute and can neither run a process, touch a file or the network, nor run a string as code.
# Every other standard-library module (sys.stdlib_module_names: private `_socket`, deprecated `imp` and
# `distutils` included) is refused with its submodules unless the spec opts in with `trust: {allow_modules:
# [...]}`: a tool's arguments are chosen by the model.
SAFE_STDLIB = frozenset(
    (
        "math cmath statistics random secrets decimal fractions numbers operator functools itertools "
        "collections heapq bisect graphlib copy enum dataclasses typing abc json re string textwrap difflib "
        "unicodedata stringprep keyword html base64 binascii hashlib hmac struct array datetime calendar time "
        "ipaddress colorsys pprint reprlib errno fnmatch "
        # their C accelerators, where what they offer is defined (`heapq.heappush.__module__` is "_heapq")
        "_abc _bisect _functools _heapq _operator _struct _hashlib _blake2 _md5 _sha1 _sha256 _sha512 _sha3 "
        "_json _random _statistics _datetime _decimal _pydecimal _collections _collections_abc _sre _string "
        "_strptime _typing"
    ).split()
)
_UNSAFE_INSIDE_SAFE = frozenset({"json.tool"})  # a command-line entry point reading files named in argv
# removed from the standard library but shimmed by setuptools, and the installers CPython ships (ensurepip)
REFUSED_OUTSIDE_STDLIB = frozenset(
    "distutils imp asynchat asyncore smtpd setuptools pkg_resources _distutils_hack pip".split()
)
# Third-party (de)serializers of code: a tool or reward naming one lets the model's arguments choose what runs.
# Whole packages where that is what they are for; single callables in packages that are otherwise fine to name
# (`numpy:mean`, `yaml:safe_load`), checked by the name written and by where the object was defined. Opting
# in to the package (`trust: {allow_modules: [torch]}`) lifts them, as for the standard library.
CODE_LOADING_PACKAGES = frozenset({"dill", "cloudpickle", "jsonpickle"})
CODE_LOADERS = frozenset(
    (
        "yaml.load yaml.load_all yaml.unsafe_load yaml.unsafe_load_all "  # YAML's !!python tags
        "torch.load torch.serialization.load torch.jit.load torch.jit._serialization.load torch.hub.load "
        "torch.hub.load_state_dict_from_url numpy.load numpy.lib.npyio.load pandas.read_pickle "
        "pandas.io.pickle.read_pickle joblib.load joblib.numpy_pickle.load"  # joblib: pickle underneath
    ).split()
)
DENIED_MODULES = (
    (frozenset(sys.stdlib_module_names) - SAFE_STDLIB) | REFUSED_OUTSIDE_STDLIB | CODE_LOADING_PACKAGES
)
# C modules behind public ones: `os.system.__module__` is "posix"; opting in to "os" covers them.
_PUBLIC = {
    "posix": "os",
    "nt": "os",
    "posixpath": "os.path",
    "ntpath": "os.path",
    "genericpath": "os.path",
    "_io": "io",
    "_pickle": "pickle",
    "_ctypes": "ctypes",
    "_socket": "socket",
    "_ssl": "ssl",
    "_signal": "signal",
    "_posixsubprocess": "subprocess",
    "_winapi": "subprocess",
    "_thread": "threading",
    "_multiprocessing": "multiprocessing",
    "_sqlite3": "sqlite3",
}
_DOTTED = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*")


class ImportPathError(Exception):
    """An import path that is malformed or cannot be resolved. `code` is its diagnostic code."""

    code = "import"


class UnsafeImportError(ImportPathError):
    """An import path into a module of DENIED_MODULES that the spec did not opt in to."""

    code = "unsafe-import"


def is_import_path(ref: str) -> bool:
    return ":" in ref


def unsafe_module(module: str, allow: Iterable[str] = ()) -> str | None:
    """The refused module (or package) that `module` is or lies in, unless `allow` names it."""
    parts = module.split(".")
    prefixes = [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
    denied = next((p for p in prefixes if p in DENIED_MODULES or p in _UNSAFE_INSIDE_SAFE), None)
    if denied is None or any(p in allow for p in (*prefixes, _PUBLIC.get(denied, denied))):
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
        what = (
            "a package that deserializes code"
            if denied in CODE_LOADING_PACKAGES
            else "a standard-library module outside the safe list (fsm.spec.registry.SAFE_STDLIB)"
        )
        raise UnsafeImportError(
            f"{subject} is {what}: it may run processes, touch files or the network, or run code, with arguments "
            f"a model may choose; if this spec means it, opt in at its top level: `trust: {{allow_modules: "
            f"[{denied}]}}`"
        )


def check_loader(name: str, allow: Iterable[str] = (), ref: str | None = None) -> None:
    """Refuse `name` (dotted: module.attr) when it is, or lies under, one of CODE_LOADERS not opted in to."""
    parts = name.split(".")
    prefixes = [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
    loader = next((p for p in prefixes if p in CODE_LOADERS), None)
    if loader is None or any(p in allow for p in prefixes):
        return
    raise UnsafeImportError(
        f"{ref or name!r} is {loader}, which runs code found in the data it loads (pickle, YAML's Python tags), "
        f"from arguments a model may choose; if this spec means it, opt in at its top level: `trust: "
        f"{{allow_modules: [{parts[0]}]}}`"
    )


def check_import_path(ref: str, allow: Iterable[str] = ()) -> tuple[str, str]:
    """`package.module:attr.sub` -> (module, attr), checked for form and the deny-list; imports nothing."""
    module_name, _, attr = ref.partition(":")
    if not _DOTTED.fullmatch(module_name) or not _DOTTED.fullmatch(attr):
        raise ImportPathError(f"{ref!r} is not an import path of the form 'package.module:name'")
    if any(part.startswith("__") for part in attr.split(".")):
        raise ImportPathError(
            f"{ref!r} names a dunder attribute; an import path names a module's own objects"
        )
    check_module(module_name, allow, ref)
    check_loader(f"{module_name}.{attr}", allow, ref)
    return module_name, attr


def add_spec_folder(folder: str | Path) -> None:
    """Make the modules beside a spec importable by their plain names (`function: my_tools:shout` next to
    `agent.yaml`), from whatever directory the run starts: the spec's folder goes at the END of sys.path, so it
    never shadows an installed package or the standard library. Process-isolated tools inherit sys.path."""
    path = str(Path(folder).resolve())
    if path not in sys.path:
        sys.path.append(path)
        importlib.invalidate_caches()


def _package_root(module: str, folder: str | Path) -> Path | None:
    """The folder above the package a spec lives in, when the module it names is in that package
    (examples/gateway/base.yaml naming `examples.gateway.harnesses`: the checkout's root), so a spec inside
    a package imports it from any working directory; None otherwise, or when that root is already importable."""
    here = Path(folder).resolve()
    packages = module.split(".")[:-1]
    for depth in range(len(packages), 0, -1):
        inside = packages[:depth]
        if here.parts[-depth:] != tuple(inside):
            continue
        root = here.parents[depth - 1]
        if all((root.joinpath(*packages[:k]) / "__init__.py").is_file() for k in range(1, depth + 1)):
            return None if str(root) in sys.path else root
    return None


def import_module(module: str, allow: Iterable[str] = (), folder: str | Path | None = None) -> ModuleType:
    """Import a module a spec lists under `imports:` (this runs its code). Raises ImportPathError; a module
    not found says where it was looked for (`folder`: the spec's)."""
    check_module(module, allow)
    if folder is not None and (root := _package_root(module, folder)) is not None:
        add_spec_folder(root)
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name is None or not (module == exc.name or module.startswith(exc.name + ".")):
            raise ImportPathError(f"cannot import module {module!r}: {type(exc).__name__}: {exc}") from None
        where = f"on sys.path and in the spec's folder {folder}" if folder is not None else "on sys.path"
        raise ImportPathError(
            f"cannot import module {module!r}: no module {exc.name!r} (looked for {where}; "
            "a module elsewhere needs its folder on PYTHONPATH, or `pip install -e` of its "
            "project)"
        ) from None
    except Exception as exc:  # a user module may fail with anything
        raise ImportPathError(f"cannot import module {module!r}: {type(exc).__name__}: {exc}") from None


def resolve(ref: str, allow: Iterable[str] = (), folder: str | Path | None = None) -> Any:
    """`package.module:attr.sub` -> the object. Raises ImportPathError with a readable reason.

    The deny-list applies to the path as written, to every module met on the way (`mine:os.system`) and
    to the module the object was defined in (`mine:system` after `from os import system`).
    """
    allow = tuple(allow)
    module_name, attr = check_import_path(ref, allow)
    obj: Any = import_module(module_name, allow, folder)
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
        qualname = getattr(obj, "__qualname__", None)
        if isinstance(qualname, str) and _DOTTED.fullmatch(qualname):
            check_loader(f"{origin}.{qualname}", allow, ref)
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
    # _named checks fn's signature first
    def factory(param: Any, limits: Any) -> Callable[[Any], bool]:
        if param is None:
            return fn
        if isinstance(param, dict):
            return lambda traj: fn(traj, **param)
        return lambda traj: fn(traj, param)

    factory.guard_fn = fn  # type: ignore[attr-defined]
    return factory


Predicate = Callable[[Any], bool]


class GuardError(Exception):
    def __init__(self, code: str, message: str, name: str | None = None):
        super().__init__(message)
        self.code = code
        self.name = name  # the guard name at fault, for "did you mean" (it may sit deep inside all/any/not)


def _builtin(name: str):
    def register(factory):
        GUARDS[name] = factory
        return factory

    return register


@_builtin("response_budget_exhausted")
def _response_budget(param: Any, limits: LimitsSpec) -> Predicate:
    budget = int(param) if param is not None else limits.response_length
    # An observation that did not fit was not appended, and the budget counts as spent (verl): without
    # the flag the trajectory would go on generating as if the tool or user had never answered.
    return lambda t: t.observation_overflow or len(t.response_mask) >= budget


def _turn_limit(name: str, attr: str):
    @_builtin(name)
    def factory(param: Any, limits: LimitsSpec) -> Predicate:
        n = param if param is not None else getattr(limits, name)
        if n is None:  # as in verl, an unset limit never stops a trajectory
            return lambda t: False
        if not isinstance(n, int) or n < 1:
            raise GuardError("type", f"guard {name!r} takes a positive integer, got {n!r}")
        return lambda t: getattr(t, attr) >= n

    return factory


_turn_limit("max_assistant_turns", "assistant_turns")
_turn_limit("max_user_turns", "user_turns")


@_builtin("has_tool_calls")
def _has_tool_calls(param: Any, limits: LimitsSpec) -> Predicate:
    return lambda t: bool(t.pending_calls)


@_builtin("should_terminate")
def _should_terminate(param: Any, limits: LimitsSpec) -> Predicate:
    return lambda t: t.should_terminate


@_builtin("has_interaction")
def _has_interaction(param: Any, limits: LimitsSpec) -> Predicate:
    return lambda t: t.interaction_kwargs is not None  # the row carries interaction_kwargs (verl's rule)


@_builtin("finish_reason")
def _finish_reason(param: Any, limits: LimitsSpec) -> Predicate:
    if param not in ("stop", "length", "abort"):
        raise GuardError("type", f"finish_reason takes stop, length or abort, got {param!r}")
    return lambda t: t.last_finish_reason == param


@_builtin("context_tokens_over")
def _context_tokens_over(param: Any, limits: LimitsSpec) -> Predicate:
    if not isinstance(param, int) or isinstance(param, bool) or param < 1:
        raise GuardError(
            "type", f"guard 'context_tokens_over' takes a positive number of tokens, got {param!r}"
        )
    # the current segment's prompt and response: what the next model turn would be given (fsm/run/rewrites.py)
    return lambda t: len(t.prompt_ids) + len(t.response_ids) > param


@_builtin("segments_at_least")
def _segments_at_least(param: Any, limits: LimitsSpec) -> Predicate:
    if not isinstance(param, int) or isinstance(param, bool) or param < 1:
        raise GuardError("type", f"guard 'segments_at_least' takes a positive integer, got {param!r}")
    return lambda t: len(t.closed) + 1 >= param


def compile_guard(
    expr: Any, limits: LimitsSpec, resolve_ref: Callable[[str], Any] = resolve
) -> tuple[Predicate, str]:
    """Guard expression -> (predicate, label for diagrams and spans). Raises GuardError.

    `resolve_ref` turns a `module:function` guard into the function (fsm.run.compile passes one that applies
    the spec's trust opt-ins, or, for static checks, one that imports nothing).
    """
    if isinstance(expr, str):
        return _named(expr, None, limits, resolve_ref), expr
    if isinstance(expr, dict) and len(expr) == 1:
        ((key, value),) = expr.items()
        if key in ("all", "any"):
            if not isinstance(value, list) or not value:
                raise GuardError("type", f"{key}: expects a non-empty list of guards")
            parts = [compile_guard(v, limits, resolve_ref) for v in value]
            preds, either = [p for p, _ in parts], all if key == "all" else any
            return (lambda t: either(p(t) for p in preds)), f" {'and' if key == 'all' else 'or'} ".join(
                lbl for _, lbl in parts
            )
        if key == "not":
            pred, label = compile_guard(value, limits, resolve_ref)
            return (lambda t: not pred(t)), f"not {label}"
        return _named(str(key), value, limits, resolve_ref), f"{key}={value}"
    raise GuardError("type", f"a guard is a name, {{name: param}}, or {{all|any|not: ...}}; got {expr!r}")


def _named(name: str, param: Any, limits: LimitsSpec, resolve_ref: Callable[[str], Any]) -> Predicate:
    factory = GUARDS.get(name)
    if factory is None and is_import_path(name):
        try:
            fn = resolve_ref(name)
        except ImportPathError as exc:
            raise GuardError(exc.code, str(exc)) from None
        if not callable(fn):
            raise GuardError("import", f"{name!r} is not callable")
        factory = _user_guard_factory(fn)
    if factory is None:
        raise GuardError(
            "unknown-guard", f"unknown guard {name!r}; built-in: {', '.join(sorted(GUARDS))}", name
        )
    if hasattr(factory, "guard_fn"):
        _check_signature(name, factory.guard_fn, param)
    return factory(param, limits)


def _check_signature(name: str, fn: Callable[..., Any], param: Any) -> None:
    """A user guard is called `fn(traj)`, `fn(traj, param)` or `fn(traj, **param)` and returns a bool at once:
    one written as an action (`async def fn(ctx, traj)`) would fail every row at run time, so refuse it here."""
    if inspect.iscoroutinefunction(fn):
        raise GuardError(
            "type",
            f"guard {name!r} must be a plain function fn(traj) -> bool, not async (guards "
            "are synchronous; an action is `async def fn(ctx, traj)`)",
        )
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin, or static validation's unimported placeholder
        return
    called = (
        "fn(traj)" if param is None else "fn(traj, **param)" if isinstance(param, dict) else "fn(traj, param)"
    )
    try:
        if param is None:
            sig.bind(None)
        elif isinstance(param, dict):
            sig.bind(None, **param)
        else:
            sig.bind(None, param)
    except TypeError as exc:
        with_param = "" if param is None else f" with {param!r}"
        bare = sig.replace(
            parameters=[p.replace(annotation=p.empty) for p in sig.parameters.values()],
            return_annotation=sig.empty,
        )  # what it takes, without annotations (strings here)
        raise GuardError(
            "type",
            f"guard {name!r} takes {bare}: it cannot be called as {called}{with_param} ({exc}); a guard is "
            "fn(traj) -> bool, or fn(traj, param) when the spec gives it a parameter",
        ) from None
