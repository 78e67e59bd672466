"""What made a run's rows, so that a resume continues the same run or refuses (issue 46).

A row's tokens come from the model's weights, its rewards and observations from the code its spec names (the
reward function, tools, guards, actions, the interaction), and its form from the engine's options. The spec and
the tokenizer are checked by hash already (fsm/run/resume.py `load`); the rest is recorded here, as `made_by` in
the journal's `run` record, and compared with what the resume runs on:

- `model`: the embedded model by a digest of its checkpoint (`checkpoint_digest`), a model object in memory by its
  name only (its weights are the caller's); servers by the model name they serve and their engine (their weight
  version is checked per row, `weights_change`: an update between the kill and the resume moves it);
- `code`: each module the spec (and its child machines' specs) names, by the sha256 of its source file;
- `engine`: the options that shape rows on resume (--check-tokens; the embedded model's dtype, device and
  --exact-logprobs).

Every difference is a `Change`; `judge` refuses the resume in one line naming the first (and counting the
others), or, with changes accepted, hands them back to be warned about and recorded in the journal (a `resume`
record, which `agentfsm show --journal` and `agentfsm replay` print), so rows made before and after can be told
apart.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import re
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fsm.run.agent import CompiledAgent
from fsm.run.engine import LocalEngine
from fsm.run.journal import JournalError
from fsm.spec.registry import is_import_path

ACCEPT = "rerun with --resume --accept-changes (RunDir(out, accept_changes=True)) to go on anyway"
# the files of a checkpoint that decide what it computes: the weights in every format, and the configs
WEIGHT_FILES = re.compile(r".*\.(safetensors|bin|pt|pth|gguf|msgpack|h5)|(generation_)?config\.json")
_DOTTED = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")
# a spec's top-level keys, named for the message ("the reward module specs/calculator.py")
_ROLES = {"reward": "reward", "tools": "tool", "states": "action or guard", "context": "rewrite"}
_ROLES |= {"imports": "imported", "demo_data": "demo data", "children": "child"}


@dataclass(frozen=True)
class Change:
    """One difference between what made a run's rows and what a resume runs on: `what` names it (one clause);
    `fix` says how to resume without it, where there is a way; `after` what accepting it means."""

    what: str
    fix: str | None = None
    after: str | None = None


class ResumeRefused(JournalError):
    """What made a journal's rows changed, and the caller did not accept changes: one line, `resume refused:`."""


def judge(path: str | Path, changes: list[Change], accept: bool) -> list[str]:
    """Nothing back when nothing changed; with `accept`, the changes as lines to warn about and record; else
    ResumeRefused of one line: `resume refused:` the journal, the first change (and how many more), the way on."""
    if not changes:
        return []
    if accept:
        return [c.what + (f" ({c.after})" if c.after else "") for c in changes]
    first = changes[0]
    more = f" (and {len(changes) - 1} more: {'; '.join(c.what for c in changes[1:])})" if changes[1:] else ""
    fix = f"; {first.fix}, or {ACCEPT}" if first.fix else f"; {ACCEPT}"
    raise ResumeRefused(f"resume refused: {path}: {first.what}{more}{fix}")


# --- digests -------------------------------------------------------------------------------------------------


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def checkpoint_digest(folder: Path) -> str:
    """One sha256 over the checkpoint's weight and config files (name, size, content), top level only (a
    checkpoint's own files; the folders beside them are other checkpoints). A file's sha256 is cached by its
    path, size, mtime, ctime and inode in ~/.cache/agentfsm/sha256.json: read once, whatever its size."""
    cache_path = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "agentfsm" / "sha256.json"
    try:
        cache = json.loads(cache_path.read_text())
        cache = cache if isinstance(cache, dict) else {}
    except (OSError, ValueError):
        cache = {}
    h, grew = hashlib.sha256(), False
    for f in sorted(p for p in folder.iterdir() if p.is_file() and WEIGHT_FILES.fullmatch(p.name)):
        st = f.stat()
        # ctime and inode too: a copy that keeps the size and mtime (`cp -p`, shutil.copy2) still changes them
        key = f"{f.resolve()}|{st.st_size}|{st.st_mtime_ns}|{st.st_ctime_ns}|{st.st_ino}"
        digest = cache.get(key)
        if not isinstance(digest, str):
            digest, grew = file_sha256(f), True
            cache[key] = digest
        h.update(f"{f.name}\0{st.st_size}\0{digest}\n".encode())
    if grew:
        with contextlib.suppress(OSError):  # a cache that cannot be written costs a read next time, no more
            cache_path.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache_path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(cache))
            tmp.replace(cache_path)
    return h.hexdigest()


def _refs(value: Any) -> Iterator[str]:
    """Every string in a spec's data, keys included (a guard may be named by import path as a key)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, Mapping):
        for k, v in value.items():
            yield from _refs(k)
            yield from _refs(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _refs(v)


def _named_modules(agent: CompiledAgent, whose: str, found: dict[str, list[str]], seen: set[int]) -> None:
    """The modules `agent`'s spec names, each with its roles (`whose`: "" for the root, "child NAME's " for a
    child machine's spec, read the same way), into `found`."""
    seen.add(id(agent))
    for key, value in agent.spec.model_dump(by_alias=True, exclude_none=True).items():
        role = whose + _ROLES.get(key, key)
        for ref in _refs(value) if key != "imports" else value:
            module = ref.split(":", 1)[0] if is_import_path(ref) else ref if key == "imports" else None
            if module and _DOTTED.fullmatch(module) and role not in found.setdefault(module, []):
                found[module].append(role)
    for name in agent.spec.children:
        child = agent.child_agent(name)
        if id(child) not in seen:
            _named_modules(child, f"child {name}'s ", found, seen)


def code_digests(agent: CompiledAgent) -> dict[str, dict[str, str]]:
    """module -> {"file", "sha256", "as"} for every module the spec names (by import path, or under
    `imports:`), its child machines' specs included, as compiled: the ones it imported (nothing is imported
    here). A module with no source file (built in) is left out. The file is read now: a process that imported a
    module before it was edited is told apart by what is on disk, which is what a fresh process would run."""
    found: dict[str, list[str]] = {}
    _named_modules(agent, "", found, set())
    out = {}
    for module, roles in found.items():
        # compiling the spec imported every module it names; any other string (a prompt's "Note: ...") is none
        file = getattr(sys.modules.get(module), "__file__", None)
        if file is not None and (path := Path(file)).is_file():
            out[module] = {"file": str(path.resolve()), "sha256": file_sha256(path), "as": ", ".join(roles)}
    return out


# --- what an engine runs on ----------------------------------------------------------------------------------


def model_of(backend: Any) -> dict[str, Any]:
    """What makes a backend's tokens: servers (the model they serve, their engine), the embedded model (its
    checkpoint's digest; a model object in memory: its name), or another backend (its kind and model name)."""
    servers = getattr(backend, "servers", None)
    if servers is not None or getattr(backend, "url", None) is not None:
        clients = [s.backend for s in servers] if servers is not None else [backend]
        engines = sorted({type(c).__name__ for c in clients})
        return {"kind": "servers", "model": str(getattr(backend, "model_name", None)), "engine": engines}
    if hasattr(backend, "checkpoint"):  # the embedded model (backends/hf.py)
        entry: dict[str, Any] = {"kind": "embedded", "model": str(backend.model_name)}
        where = backend.checkpoint
        if where is not None and Path(where).is_dir():
            entry["checkpoint"] = str(Path(where).resolve())
            entry["sha256"] = checkpoint_digest(Path(where))
        elif where is not None:  # a hub id: its revision
            entry["checkpoint"] = str(where)
            entry["revision"] = getattr(getattr(backend.model, "config", None), "_commit_hash", None)
        return entry
    return {"kind": type(backend).__name__, "model": str(getattr(backend, "model_name", None))}


def options_of(engine: LocalEngine) -> dict[str, Any]:
    """The engine's options that shape rows on resume (the rows' sampling comes from the journal)."""
    out: dict[str, Any] = {"check_tokens": bool(engine.runner.check_tokens)}
    backend: Any = engine.backend  # the in-process model's options, where it is one (it has a checkpoint)
    if hasattr(backend, "checkpoint"):
        out["dtype"] = str(backend.dtype).removeprefix("torch.")
        out["device"] = getattr(backend.device, "type", str(backend.device))
        out["exact_logprobs"] = bool(getattr(backend, "exact_logprobs", False))
    return out


async def made_by(engine: LocalEngine) -> dict[str, Any]:
    """What `engine` makes rows with (started: servers have said what they serve), for the journal's `made_by`.
    A checkpoint's digest reads its files on a thread (once: then cached)."""
    await engine.start()

    def collect() -> dict[str, Any]:
        policies = {
            name: model_of(p.backend)
            for name, p in sorted(engine.runner.policies.items())
            if p.backend is not None and p.backend is not engine.backend
        }
        out = {
            "model": model_of(engine.backend),
            "code": code_digests(engine.agent),
            "engine": options_of(engine),
        }
        return {**out, "policies": policies} if policies else out

    return await asyncio.to_thread(collect)


# --- differences ---------------------------------------------------------------------------------------------


def _sha256s(was: Any, now: Any) -> str:
    return "sha256 " + " -> ".join(f"{str(d)[:8]}.." if d else "none" for d in (was, now))


def _shown(file: str) -> str:
    """A path as a user would type it: relative to the working directory when under it."""
    with contextlib.suppress(ValueError):
        return str(Path(file).relative_to(Path.cwd()))
    return file


def _describe(m: Mapping[str, Any]) -> str:
    if m.get("kind") == "servers":
        return f"servers serving {m.get('model')!r} ({', '.join(m.get('engine') or [])})"
    if m.get("kind") == "embedded":
        return f"the embedded model {m.get('model')!r}" + (
            f" from {m['checkpoint']}" if m.get("checkpoint") else " (a model object in memory)"
        )
    return f"a {m.get('kind')} backend ({m.get('model')!r})"


def model_changes(before: Mapping[str, Any], now: Mapping[str, Any], whose: str = "") -> list[Change]:
    other = f"the run's rows{whose} were made by {_describe(before)}, but this resume runs {_describe(now)}"
    if before.get("kind") != now.get("kind"):
        fix = "give the servers again with --server URL" if before.get("kind") == "servers" else None
        return [Change(other, fix)]
    if now.get("kind") == "servers":
        out = []
        was, serves = before.get("model"), now.get("model")
        if was != serves and not {was, serves} & {"unknown", "None"}:  # "unknown": servers not read at start
            msg = f"the servers{whose} serve model {serves!r}, but the run's rows were made by {was!r}"
            out.append(Change(msg, f"give servers of {was!r}"))
        if before.get("engine") != now.get("engine"):
            ran = f"the servers{whose} run {now.get('engine')}, the run's ran {before.get('engine')}"
            out.append(Change(ran))
        return out
    if now.get("sha256") or before.get("sha256"):  # a checkpoint's files: the same, wherever they are now
        same = before.get("sha256") == now.get("sha256")
    else:  # a hub id at its revision, a model object in memory, another backend: by name
        same = all(before.get(k) == now.get(k) for k in ("model", "checkpoint", "revision"))
    if same:
        return []
    if before.get("checkpoint") == now.get("checkpoint") and before.get("checkpoint"):
        digests = _sha256s(before.get("sha256"), now.get("sha256"))
        msg = f"the model's checkpoint{whose} {now['checkpoint']} changed since the run started ({digests})"
        return [Change(msg)]
    return [Change(other)]


def changes(before: Mapping[str, Any] | None, now: Mapping[str, Any]) -> list[Change]:
    """What differs between `before` (a journal's `made_by`; None in a journal older than it: nothing to
    compare) and `now` (the parts it holds: the CLI checks the code before it loads a model)."""
    if not before:
        return []
    out = model_changes(before.get("model") or {}, now["model"]) if "model" in now else []
    was_p, now_p = before.get("policies") or {}, now.get("policies") or {}
    for name in sorted(set(was_p) | set(now_p)) if "model" in now else ():
        out += model_changes(was_p.get(name) or {}, now_p.get(name) or {}, f" of policy {name!r}")
    was_c, now_c = before.get("code") or {}, now.get("code") or {}
    for module, was in was_c.items() if "code" in now else ():
        cur = now_c.get(module)
        if cur is None:
            gone = f"the {was.get('as')} module {module} ({_shown(was.get('file', '?'))}) is gone"
            out.append(Change(gone))
        elif cur.get("sha256") != was.get("sha256"):
            file = _shown(cur.get("file", module))
            digests = _sha256s(was.get("sha256"), cur.get("sha256"))
            msg = f"the {was.get('as')} module {file} changed since the run started ({digests})"
            out.append(Change(msg, f"put {file} back as it was"))
    was_e, now_e = before.get("engine") or {}, now.get("engine") or {}
    for key in sorted(set(was_e) & set(now_e)):
        if was_e[key] != now_e[key]:
            flag, was = "--" + key.replace("_", "-"), was_e[key]
            fix = f"resume {'with' if was else 'without'} {flag}" if isinstance(was, bool) else None
            fix = fix or f"resume with {flag} {was}"
            out.append(Change(f"{flag} is {now_e[key]!r}, the run's was {was!r}", fix))
    return out
