"""The control calls of an engine: pause and resume generation, weight updates (from disk, tensors or a
process group), memory release and reclaim, cache flush, each on every server, in an async form and a sync one.
A mixin of RolloutEngine (fsm/api.py), which provides the engine's loop and backend.

The engine's weight version lives at the run's gate (fsm/run/context.py `PauseGate`): a pause closes the
gate first, so that no model request slips past while the servers pause, and a weight update counts the
version that the next generated tokens record. Each call is also an event on the root span of every
trajectory in flight (traced ones).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from backends.base import Backend
from fsm.run.runtime import Runner

PAUSE_MODES = ("abort", "retract", "in_place")  # SGLang's /pause_generation modes


class ControlCalls:
    """RolloutEngine's control calls (a mixin: the engine provides `_on_home`, `_start`, `_run_sync` and
    `_refuse_in_loop`)."""

    backend: Backend
    runner: Runner

    async def _control(self, method: str, *args: Any, required: bool = False, **kwargs: Any) -> Any:
        return await self._on_home(self._control_here(method, args, kwargs, required))

    async def _control_here(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any],
                            required: bool) -> Any:  # fmt: skip
        await self._start()
        fn = getattr(self.backend, method, None)
        if fn is None:
            if required:
                raise NotImplementedError(f"backend {self.backend.model_name!r} ({type(self.backend).__name__}) "
                                          f"has no {method}()")  # fmt: skip
            return None  # e.g. sleep on an in-process model: nothing to release
        return await fn(*args, **kwargs)

    async def asleep(self, tags: list[str] | None = None) -> Any:
        """Release server memory (SGLang release_memory_occupation; tags "weights", "kv_cache")."""
        return await self._control("sleep", tags)

    async def awake_up(self, tags: list[str] | None = None) -> Any:
        """Take the memory back (SGLang resume_memory_occupation)."""
        return await self._control("wake_up", tags)

    @property
    def weight_version(self) -> int:
        """The weights the servers hold: 0 at first (or the int they report), then each update's version."""
        return self.runner.gate.version

    @property
    def paused(self) -> bool:
        """True between `pause()` and `resume()`: no model request is issued meanwhile."""
        return self.runner.gate.paused

    async def apause(self, mode: str = "abort") -> None:
        """Stop generation: the engine issues no new model request (turns wait at its gate) and every server
        pauses (`/pause_generation`; the in-process model the same). `mode`: "abort" ends running requests
        with their partial output, which the engine keeps and resumes after `resume()`; "retract" requeues
        them at the server (recomputed after continue); "in_place" holds them mid-generation. Trajectories stay
        alive with their partial turns; new runs may start meanwhile and wait at the gate."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"unknown pause mode {mode!r}; expected one of {', '.join(PAUSE_MODES)}")
        await self._on_home(self._pause_here(mode))

    async def _pause_here(self, mode: str) -> None:
        await self._start()
        gate = self.runner.gate
        was_paused = gate.paused
        gate.close()  # first: nothing slips past while the servers pause
        try:
            await self._control_here("pause_generation", (mode,), {}, True)
        except BaseException:
            if not was_paused:
                gate.open()
            raise
        self._event("pause", {"agentfsm.pause.mode": mode, "agentfsm.weight_version": gate.version})

    async def aresume(self) -> None:
        """Continue: every server continues (`/continue_generation`), then the gate opens and paused
        trajectories go on, on whatever weights the servers now hold."""
        await self._on_home(self._resume_here())

    async def _resume_here(self) -> None:
        await self._start()
        await self._control_here("continue_generation", (), {}, True)
        self.runner.gate.open()
        self._event("resume", {"agentfsm.weight_version": self.runner.gate.version})

    async def aupdate_weights_from_disk(self, path: str | Path, weight_version: int | None = None,
                                        **options: Any) -> int:  # fmt: skip
        """Reload weights on every server (or the in-process model) from a checkpoint directory, as version
        `weight_version` (default: the current one + 1), which is returned. `options` go to SGLang's
        endpoint (load_format, abort_all_requests, flush_cache)."""
        return await self._on_home(self._update_here("update_weights_from_disk", (str(path),), options,
                                                     weight_version))  # fmt: skip

    async def aupdate_weights_from_tensor(self, weight_version: int | None = None, **payload: Any) -> int:
        """SGLang's `/update_weights_from_tensor` on every server (payload passed through:
        serialized_named_tensors, load_format, flush_cache...); the new version is returned."""
        return await self._on_home(
            self._update_here("update_weights_from_tensor", (), payload, weight_version)
        )

    async def aupdate_weights_from_distributed(
        self, weight_version: int | None = None, **payload: Any
    ) -> int:
        """SGLang's `/update_weights_from_distributed` on every server (payload passed through: names, dtypes,
        shapes, group_name...); the new version is returned."""
        return await self._on_home(self._update_here("update_weights_from_distributed", (), payload,
                                                     weight_version))  # fmt: skip

    async def _update_here(self, method: str, args: tuple[Any, ...], options: dict[str, Any],
                           weight_version: int | None) -> int:  # fmt: skip
        await self._start()
        gate = self.runner.gate
        if weight_version is not None and (
            isinstance(weight_version, bool) or not isinstance(weight_version, int)
        ):
            raise TypeError(
                f"weight_version must be an int (the engine counts versions), got {weight_version!r}"
            )
        version = gate.version + 1 if weight_version is None else weight_version
        await self._control_here(method, args, {**options, "weight_version": str(version)}, True)
        gate.version = version
        self._event(
            "weight_update", {"agentfsm.weight_version": version, "agentfsm.weight_update.method": method}
        )
        return version

    def _event(self, name: str, attributes: dict[str, Any]) -> None:
        """A control event on the root span of every trajectory in flight (traced ones)."""
        for _, root in list(self.runner.live.values()):
            add = getattr(root, "add_event", None)
            if add is not None:
                add(name, attributes)

    async def aflush_cache(self) -> Any:
        return await self._control("flush_cache")

    def sleep(self, tags: list[str] | None = None) -> Any:
        self._refuse_in_loop("sleep", "asleep")
        return self._run_sync(self.asleep(tags))

    def wake_up(self, tags: list[str] | None = None) -> Any:
        self._refuse_in_loop("wake_up", "awake_up")
        return self._run_sync(self.awake_up(tags))

    def update_weights_from_disk(
        self, path: str | Path, weight_version: int | None = None, **options: Any
    ) -> int:
        self._refuse_in_loop("update_weights_from_disk", "aupdate_weights_from_disk")
        return self._run_sync(self.aupdate_weights_from_disk(path, weight_version, **options))

    def update_weights_from_tensor(self, weight_version: int | None = None, **payload: Any) -> int:
        self._refuse_in_loop("update_weights_from_tensor", "aupdate_weights_from_tensor")
        return self._run_sync(self.aupdate_weights_from_tensor(weight_version, **payload))

    def update_weights_from_distributed(self, weight_version: int | None = None, **payload: Any) -> int:
        self._refuse_in_loop("update_weights_from_distributed", "aupdate_weights_from_distributed")
        return self._run_sync(self.aupdate_weights_from_distributed(weight_version, **payload))

    def pause(self, mode: str = "abort") -> None:
        self._refuse_in_loop("pause", "apause")
        self._run_sync(self.apause(mode))

    def resume(self) -> None:
        self._refuse_in_loop("resume", "aresume")
        self._run_sync(self.aresume())

    def flush_cache(self) -> Any:
        self._refuse_in_loop("flush_cache", "aflush_cache")
        return self._run_sync(self.aflush_cache())
