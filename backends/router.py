"""A Backend over several backends: sticky sessions, least-requests placement, group affinity.

Placement, in order:
1. a session already pinned to a healthy server stays there ("sticky"): every turn reuses its prefix cache.
   A running session never moves for load, only when its server is down;
2. with `group_affinity`, a new session of a GRPO group goes where its group went ("group"), unless that
   server has more than `group_imbalance` requests in flight above the least-loaded one (a group is one unit
   of placement: the bound below places its first session, its samples follow to share their prompt);
3. otherwise the healthy server with the fewest requests in flight ("new"), among those within their bounded
   share. Ties go to the server with the fewest pinned sessions, then the lowest index: placement is
   deterministic.
Bounded load (consistent hashing with bounded loads, Mirrokni et al. 2018): a server takes a new session only
while it holds at most `load_bound` times the fair share of the pinned sessions (ceil(load_bound * (pinned +
1) / healthy servers)); a full server keeps its running sessions and the new ones go elsewhere.

Scheduling by state: `priority` (e.g. `by_turn`) maps each request to the engine's request priority (lower
runs first on a server started with vLLM's `--scheduling-policy priority`), from what the engine knows of its
trajectory: its turn and its remaining budget. Where turns wait in a server's queue, serving late turns first
shortens a trajectory's wait per turn; it does not shorten a saturated synchronous step, whose end is set by
the servers' throughput (docs/benchmarks.md, the modeled fleet), so it is off by default.
A session whose server is down is re-pinned by rule 3 and counted as "moved". When no server is marked
healthy, all of them are candidates again (a mark may be stale; a dead fleet then fails per request).

Failover: a retryable failure (a server fault the client already retried, or a timeout) marks the server
down and re-runs placement, under the `failover` retry policy (`backends.base.RetryPolicy`): a few re-routes, and
more while the request is within `retry_window_s` of its first attempt, so an outage of the whole fleet
shorter than that window is waited out. No re-route starts past the window (when it is not 0: then the few
re-routes alone), so a request ends within the window and one attempt (a request timeout and its abort's
grace) however slowly its servers fail. A server that failed stays
out for a cooldown, whatever its /health says, that doubles with each consecutive incident (5 s, 10 s, ... up
to 5 min): a server whose /health answers while its /generate hangs must not take new sessions every health
interval. An incident is one strike however many requests it failed (a crash fails every request in flight),
and a success resets the count. Every re-route is counted ("retries"; "failovers" when it changed
server), and `stats()["faults"]` sums what the clients met, by kind.

This is manual/min_load routing in the terms of SGLang's model gateway (smg), plus what smg's HTTP router
lacks: exact abort targeting and control calls broadcast to every server.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from backends.base import (
    Abortable,
    Backend,
    BackendError,
    BaseBackend,
    Counted,
    GenerateRequest,
    GenerateResult,
    Lifecycle,
    RetryPolicy,
    retry,
)
from backends.engines import ENGINES, one_kind


def by_turn(request: GenerateRequest, cap: int = 8) -> int:
    """vLLM's priority (lower first) from the trajectory's progress: -turn, capped so that a request's
    advantage is bounded and a first turn waits behind at most `cap` levels (no starvation: every waiting
    trajectory's next turn climbs)."""
    return -min(request.turn, cap)


@dataclass(eq=False, slots=True)
class _Server:
    backend: Backend
    name: str
    healthy: bool = True
    in_flight: int = 0
    requests: int = 0
    failures: int = 0
    sessions: int = 0  # sessions pinned here now
    streak: int = 0  # consecutive failed requests (a success resets it)
    down_until: float = 0.0  # monotonic time before which health checks may not bring it back


@dataclass(slots=True)
class _Session:
    server: int
    group: str | None


@dataclass(slots=True)
class _Group:
    server: int
    sessions: int = 0  # live sessions of the group: the entry goes when the last one is released


class Router(BaseBackend):
    """Routes each trajectory's turns to one of `backends`. Owns them: `start()`/`close()` reach every one."""

    def __init__(
        self,
        backends: Sequence[Backend],
        *,
        group_affinity: bool = False,
        group_imbalance: int = 8,  # in-flight excess over the least-loaded server a group may cause (≈ one group)
        # a server takes new sessions up to this x its fair share; None: no bound
        load_bound: float | None = 1.25,
        priority: Callable[[GenerateRequest], int | None] | None = None,  # request -> priority (by_turn)
        max_retries: int = 2,  # re-routes after a retryable failure, each maybe to another server
        health_interval_s: float = 5.0,  # 0 disables the background health checks
        health_timeout_s: float = 30.0,  # SGLang's /health itself waits up to 20 s
        failover: RetryPolicy | None = None,  # replaces max_retries/retry_window_s: attempts and waits
        # Re-routes go on past max_retries while within this many seconds of a request's first attempt, so a
        # fleet-wide outage shorter than this (a restart, a 503 window) costs time, not rows.
        retry_window_s: float = 60.0,
        cooldown_s: float = 5.0,  # a failed server stays out this long, doubled per consecutive failure...
        cooldown_max_s: float = 300.0,  # ...up to this
    ):
        if not backends:
            raise ValueError("Router needs at least one backend")
        self.servers = [
            _Server(b, getattr(b, "url", None) or f"{b.model_name}#{i}") for i, b in enumerate(backends)
        ]
        self.group_affinity = group_affinity
        self.group_imbalance = group_imbalance
        if load_bound is not None and load_bound < 1.0:
            raise ValueError(f"Router load_bound {load_bound}: must be >= 1.0 (the fair share) or None")
        self.load_bound = load_bound
        self.priority = priority
        # Re-route almost at once (another server is likely fine), backing off up to 2 s while the fleet fails.
        self.failover = failover or RetryPolicy(
            attempts=1 + max_retries,
            backoff_s=0.02,
            multiplier=3.0,
            backoff_max_s=2.0,
            window_s=retry_window_s,
        )
        self.max_retries = self.failover.attempts - 1
        self.cooldown_s, self.cooldown_max_s = cooldown_s, cooldown_max_s
        self.health_interval_s = health_interval_s
        self.health_timeout_s = health_timeout_s
        self.provider = backends[0].provider
        # A fleet is one engine kind (backends/engines.py): a mix of SGLang and vLLM servers is refused.
        known = [(getattr(b, "url", "?"), b.provider) for b in backends if b.provider in ENGINES]
        if known:
            one_kind([u for u, _ in known], [e for _, e in known])
        self._sessions: dict[str, _Session] = {}
        self._groups: dict[str, _Group] = {}
        self._health_task: asyncio.Task[None] | None = None
        self._paused = False  # between pause_generation and continue_generation: no health checks
        # placements by route; re-routes after a failure (failovers: to another server); resumed requests
        self.counts = {
            "sticky": 0,
            "new": 0,
            "group": 0,
            "moved": 0,
            "retries": 0,
            "failovers": 0,
            "resumes": 0,
            "bounded": 0,  # new sessions (or groups) sent past a server over its bounded share
        }
        self.prompt_tokens = 0
        self.cached_tokens = 0

    @property
    def model_name(self) -> str:  # type: ignore[override]  # read-only: the first server's served name, once the first server has read it from /model_info
        return self.servers[0].backend.model_name

    @property
    def context_length(self) -> int | None:  # type: ignore[override]  # read-only: the smallest server's
        known = [s.backend.context_length for s in self.servers if s.backend.context_length]
        return min(known) if known else None

    # -- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        for s in self.servers:
            if isinstance(s.backend, Lifecycle):
                await s.backend.start()
        if self._health_task is None and self.health_interval_s > 0:
            self._health_task = asyncio.create_task(self._health_loop(), name="router health checks")

    async def close(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()  # awaited for its end, not its CancelledError: a caller's own stays
            await asyncio.wait({self._health_task})
            self._health_task = None
        for s in self.servers:
            if isinstance(s.backend, Lifecycle):
                await s.backend.close()

    async def _health_loop(self) -> None:
        """One probe loop per server: a busy server's slow /health (SGLang's is a generate, queued behind
        the running requests: seconds under load) must not delay noticing that another one is back."""
        await asyncio.gather(*(self._probe_loop(s) for s in self.servers))

    async def _probe_loop(self, s: _Server) -> None:
        while True:
            await asyncio.sleep(self.health_interval_s)
            if not self._paused:  # a paused SGLang's /health (a 1-token generate) waits, then answers 503
                await self._probe(s)

    async def _probe(self, s: _Server) -> None:
        health = getattr(s.backend, "health", None)
        ok = True
        if health is not None:
            try:  # not wait_for: on 3.11 it returns an answer that came as the probe was cancelled (close())
                async with asyncio.timeout(self.health_timeout_s):
                    ok = bool(await health())
            except Exception:
                ok = False
        s.healthy = ok and time.monotonic() >= s.down_until  # a failed server sits out its cooldown

    async def check_health(self) -> list[bool]:
        """Probe every server once; a backend without `health()` is assumed healthy (it cannot be checked)."""
        await asyncio.gather(*(self._probe(s) for s in self.servers))
        return [s.healthy for s in self.servers]

    async def health(self) -> bool:
        return any(s.healthy for s in self.servers)

    # -- placement -------------------------------------------------------------------------------

    def _cap(self) -> int | None:
        """The most sessions a server may hold and still take a new one (None: no bound)."""
        if self.load_bound is None:
            return None
        pinned = healthy = 0
        for s in self.servers:  # one loop, not two generators: this runs for every new session
            pinned += s.sessions
            healthy += s.healthy
        return math.ceil(self.load_bound * (pinned + 1) / (healthy or len(self.servers)))

    def _least_loaded(self, cap: int | None = None) -> int:
        best, best_key = -1, (0, 0)
        for i, s in enumerate(self.servers):
            if not s.healthy or (cap is not None and s.sessions >= cap):
                continue
            if best < 0 or (s.in_flight, s.sessions) < best_key:
                best, best_key = i, (s.in_flight, s.sessions)
        if best < 0 and cap is not None:  # every healthy server at its bound (a rounding edge): no bound
            return self._least_loaded(None)
        if best < 0:  # nothing marked healthy: the marks may be stale, so every server is a candidate
            best = min(
                range(len(self.servers)), key=lambda i: (self.servers[i].in_flight, self.servers[i].sessions)
            )
        return best

    def choose(self, session_id: str, group_id: str | None = None) -> int:
        """Which server the next request of `session_id` goes to. Pure: nothing is recorded."""
        pinned = self._sessions.get(session_id)
        if pinned is not None and self.servers[pinned.server].healthy:
            return pinned.server
        cap = self._cap() if pinned is None else None  # a moved session goes where load is least
        least = self._least_loaded(cap)
        if self.group_affinity and group_id is not None and pinned is None:
            g = self._groups.get(group_id)
            if g is not None:
                home = self.servers[g.server]
                if home.healthy and home.in_flight - self.servers[least].in_flight <= self.group_imbalance:
                    return g.server
        return least

    def _over_bound(self, idx: int) -> bool:
        """Did the bound send this new session past the server that load alone would have chosen?"""
        if self.load_bound is None:
            return False
        unbounded = self._least_loaded(None)  # load alone chose `idx` (the usual case): no bound to read
        if unbounded == idx:
            return False
        cap = self._cap()
        return cap is not None and self.servers[unbounded].sessions >= cap

    def _pin(self, request: GenerateRequest, idx: int) -> str:
        """Record that `request` goes to server `idx`; returns the route kind."""
        sid, gid = request.session_id, request.group_id
        s = self._sessions.get(sid)
        if s is None:
            self.counts["bounded"] += self._over_bound(idx)
            self._sessions[sid] = _Session(idx, gid if self.group_affinity else None)
            self.servers[idx].sessions += 1
            route = "new"
            if self.group_affinity and gid is not None:
                g = self._groups.get(gid)
                if g is None:
                    self._groups[gid] = _Group(idx, 1)
                else:
                    g.sessions += 1
                    if g.server == idx:
                        route = "group"
                    elif not self.servers[g.server].healthy:
                        g.server = idx  # the group's server is down: its later sessions follow this one
        elif s.server == idx:
            route = "sticky"
        else:
            self.servers[s.server].sessions -= 1
            self.servers[idx].sessions += 1
            g = self._groups.get(s.group) if s.group is not None else None
            if g is not None and g.server == s.server:
                g.server = idx
            s.server = idx
            route = "moved"
        self.counts[route] += 1
        return route

    # -- generation ------------------------------------------------------------------------------

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        if self.priority is not None and request.priority is None:
            request.priority = self.priority(request)
        if request.resumed:
            self.counts["resumes"] += 1
        tried: list[int] = []  # servers tried for this request, in order
        start = time.monotonic()
        try:  # the first attempt: the failover machinery below is entered only after a failure
            return await self._attempt(request, 1, tried)
        except Exception as exc:
            failed = exc
        window = self.failover.window_s
        until = start + window if window else None  # no re-route starts past it

        def retryable(e: BaseException) -> bool:
            return self._retryable(e) and (until is None or time.monotonic() < until)

        try:
            return await retry(
                self.failover,
                lambda n: self._attempt(request, n, tried),
                retryable=retryable,
                failed=(failed, start),
            )
        except BackendError as e:
            if not (self._paused and e.retryable):
                raise
            # The fleet was paused while this request kept failing (an interrupt's abort-mode pause during an
            # outage): answer it as aborted with nothing generated, so the engine parks it at its pause gate
            # and resumes it later, instead of retrying against a paused fleet for the whole window.
            return GenerateResult(
                token_ids=[],
                logprobs=[] if request.return_logprob else None,
                finish_reason="abort",
                server=e.server,
                abort_message=f"paused: {e}",
                extra={"abort_kind": "waiting"},
            )
        finally:
            del failed  # caught here, it holds this frame: kept, both wait for the collector

    async def _attempt(self, request: GenerateRequest, n: int, tried: list[int]) -> GenerateResult:
        """Attempt `n` of `request`: placed (`choose`, `_pin`), sent, and counted; a retryable failure takes
        its server out (`_failed`)."""
        idx = self.choose(request.session_id, request.group_id)
        if n > 1:
            self.counts["retries"] += 1
            self.counts["failovers"] += int(idx != tried[-1])
        tried.append(idx)
        route = self._pin(request, idx)
        s = self.servers[idx]
        s.in_flight += 1
        s.requests += 1
        try:
            result = await s.backend.generate(request)
        except BackendError as e:
            if e.retryable:
                self._failed(s)
            raise
        finally:
            s.in_flight -= 1
        s.streak = 0
        result.route = route
        result.server = result.server or s.name
        self.prompt_tokens += len(request.prompt_ids)
        self.cached_tokens += result.cached_tokens or 0
        return result

    def _retryable(self, e: BaseException) -> bool:
        return self.failover.retryable(e) and not self._paused

    def _failed(self, s: _Server) -> None:
        """Take `s` out until a health check after its cooldown says otherwise; its sessions move on retry.

        One incident is one strike: the requests that were in flight when a server crashed all fail, but only
        the first, which finds it in service, starts (or doubles) the cooldown. The others find it already
        out and change nothing, so a server that answers /health again is back at the next health check
        after one cooldown, however many requests the crash cut."""
        s.failures += 1
        if not s.healthy:
            return  # already out: the same incident
        s.streak += 1
        s.healthy = False
        cooldown = min(self.cooldown_max_s, self.cooldown_s * 2 ** (s.streak - 1))
        s.down_until = time.monotonic() + cooldown

    async def release(self, session_id: str) -> None:
        """The trajectory ended: forget its pin (and its group's, with the group's last session)."""
        s = self._sessions.pop(session_id, None)
        if s is None:
            return
        self.servers[s.server].sessions -= 1
        if s.group is not None:
            g = self._groups.get(s.group)
            if g is not None:
                g.sessions -= 1
                if g.sessions <= 0:
                    del self._groups[s.group]
        await self.servers[s.server].backend.release(session_id)

    def where(self, session_id: str) -> str | None:
        """The server (and request) a session is pinned to: for the engine's watchdog report."""
        s = self._sessions.get(session_id)
        if s is None:
            return None
        server = self.servers[s.server]
        where = getattr(server.backend, "where", None)
        return (where(session_id) if where is not None else None) or server.name

    async def abort(self, session_id: str) -> None:
        """Abort the session's in-flight request on the one server that runs it."""
        s = self._sessions.get(session_id)
        if s is not None:
            backend = self.servers[s.server].backend
            if isinstance(backend, Abortable):
                await backend.abort(session_id)

    # -- control calls, to every server that has them -------------------------------------------

    async def _broadcast(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Call `method` on every backend that has it (down ones too: they must not keep stale weights
        unnoticed). Raises the first failure after all calls ended."""
        calls = [
            getattr(s.backend, method)(*args, **kwargs) for s in self.servers if hasattr(s.backend, method)
        ]
        results = await asyncio.gather(*calls, return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                raise r
        return results

    async def flush_cache(self) -> list[Any]:
        return await self._broadcast("flush_cache")

    async def sleep(self, tags: list[str] | None = None) -> list[Any]:
        return await self._broadcast("sleep", tags)

    async def wake_up(self, tags: list[str] | None = None) -> list[Any]:
        return await self._broadcast("wake_up", tags)

    async def update_weights_from_disk(
        self, path: str, weight_version: str | None = None, **options: Any
    ) -> list[Any]:
        return await self._broadcast(
            "update_weights_from_disk", path, weight_version=weight_version, **options
        )

    async def update_weights_from_tensor(
        self, weight_version: str | None = None, **payload: Any
    ) -> list[Any]:
        return await self._broadcast("update_weights_from_tensor", weight_version=weight_version, **payload)

    async def update_weights_from_distributed(
        self, weight_version: str | None = None, **payload: Any
    ) -> list[Any]:
        return await self._broadcast(
            "update_weights_from_distributed", weight_version=weight_version, **payload
        )

    async def init_weights_update_group(self, **payload: Any) -> list[Any]:
        return await self._broadcast("init_weights_update_group", **payload)

    async def destroy_weights_update_group(self, **payload: Any) -> list[Any]:
        return await self._broadcast("destroy_weights_update_group", **payload)

    async def model_info(self) -> dict[str, Any]:
        """The first server's /model_info that answers (its weight_version is the fleet's after an update)."""
        for s in self.servers:
            info = getattr(s.backend, "model_info", None)
            if info is not None:
                with contextlib.suppress(Exception):
                    return await info()
        return {}

    async def pause_generation(self, mode: str = "abort") -> list[Any]:
        self._paused = True
        return await self._broadcast("pause_generation", mode)

    async def continue_generation(self) -> list[Any]:
        results = await self._broadcast("continue_generation")
        self._paused = False
        return results

    # -- numbers ---------------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Placement, failover and cache counters; `faults` sums what each server's client met, by kind."""
        servers = []
        faults: dict[str, int] = {}
        client_totals = {"client_retries": 0, "aborts_sent": 0}
        for s in self.servers:
            entry: dict[str, Any] = {
                "server": s.name,
                "healthy": s.healthy,
                "in_flight": s.in_flight,
                "requests": s.requests,
                "failures": s.failures,
                "sessions": s.sessions,
            }
            if isinstance(s.backend, Counted):
                own = s.backend.stats()
                entry["faults"] = dict(own.get("faults", {}))
                for kind, count in entry["faults"].items():
                    faults[kind] = faults.get(kind, 0) + count
                client_totals["client_retries"] += own.get("retries", 0)
                client_totals["aborts_sent"] += own.get("aborts_sent", 0)
            servers.append(entry)
        return {
            "servers": servers,
            **self.counts,
            **client_totals,
            "faults": faults,
            "sessions": len(self._sessions),
            "groups": len(self._groups),
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "cache_hit_rate": self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0,
        }
