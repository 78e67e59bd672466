"""One retry policy for every remote call: how often to try, how long to wait, which failures deserve a retry.

The SGLang client retries one server, the router fails over across servers, tools and the OTLP exporter
retry their own calls. Each makes the same three decisions, so each takes a `RetryPolicy` value and (when
it is async) lets `retry()` run the loop:

    policy = RetryPolicy(attempts=4, backoff_s=0.05)                  # 4 tries, whatever they cost
    policy = RetryPolicy(attempts=3, backoff_s=0.1, window_s=60.0)   # or on until a minute has passed
    result = await retry(policy, lambda attempt: call(), on_retry=count)

A failure is retried when the policy says so: by default, an exception whose `retryable` attribute is true
(`backends.base.BackendUnavailable` and its kind), or an HTTP status in `statuses` (for callers that see
statuses rather than exceptions). An exception may carry `retry_after` (seconds, from the server's
`Retry-After` header): the next wait is then at least that long, up to `retry_after_max_s`.
Cancellation is never retried: only `Exception` subclasses are caught.
"""

from __future__ import annotations

import asyncio
import email.utils
import math
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")

# The retryable statuses of SGLang's model gateway (smg): timeouts, throttling, and the 5xx a restart gives.
RETRY_STATUSES = frozenset({408, 429, 500, 502, 503, 504})


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    attempts: int = 4  # total attempts, the first included: 1 means never retry
    backoff_s: float = 0.05  # wait before the second attempt
    multiplier: float = 2.0  # each later wait is this many times the one before...
    backoff_max_s: float = 5.0  # ...up to this, jitter included
    jitter: float = 0.2  # ±20 % on every wait, so clients that failed together do not retry together
    statuses: frozenset[int] = RETRY_STATUSES  # HTTP statuses worth another attempt
    retry_after_max_s: float = 30.0  # a server's Retry-After is honoured up to this
    # Past `attempts`, keep retrying while the next attempt starts within this many seconds of the first:
    # a budget in time rides out an outage (a server restart) whatever the per-attempt cost. None: count only.
    window_s: float | None = None

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError(
                f"RetryPolicy.attempts must be >= 1 (the first attempt counts), got {self.attempts}"
            )

    def delay(self, attempt: int, retry_after: float | None = None) -> float:
        """Seconds to wait after failed attempt number `attempt` (1-based) before the next one: never more than
        `backoff_max_s`, jitter included (capped after it), however large `attempt` grows; a server's
        `Retry-After` may ask for longer, up to `retry_after_max_s`."""
        base = self._base(attempt)
        wait = (
            min(self.backoff_max_s, base * random.uniform(1 - self.jitter, 1 + self.jitter))
            if base > 0
            else 0.0
        )
        if retry_after is not None:
            wait = max(wait, min(retry_after, self.retry_after_max_s))
        return wait

    def _base(self, attempt: int) -> float:
        """backoff_s * multiplier ** (attempt - 1), for any attempt: 2.0 ** 1024 is past a float (attempt 1,025
        once raised OverflowError, a backoff of 0 too), so a power that overflows is taken in logs."""
        if self.backoff_s <= 0:
            return 0.0
        try:
            return self.backoff_s * float(self.multiplier) ** (attempt - 1)
        except OverflowError:
            return math.exp(min(math.log(self.backoff_s) + (attempt - 1) * math.log(self.multiplier), 700.0))

    def retryable_status(self, status: int | None) -> bool:
        return status is not None and status in self.statuses

    @staticmethod
    def retryable(exc: BaseException) -> bool:
        """The default test: the exception says it is worth another try (`exc.retryable`)."""
        return bool(getattr(exc, "retryable", False))


def parse_retry_after(value: str | None) -> float | None:
    """An HTTP `Retry-After` value (delta-seconds or an HTTP date) as seconds from now; None if absent or bad."""
    if not value:
        return None
    value = value.strip()
    try:
        seconds = float(value)
    except ValueError:
        pass
    else:
        return max(0.0, seconds) if math.isfinite(seconds) else None
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


async def retry(
    policy: RetryPolicy,
    attempt_fn: Callable[[int], Awaitable[T]],
    *,
    retryable: Callable[[BaseException], bool] | None = None,
    on_retry: Callable[[int, BaseException, float], None] | None = None,
) -> T:
    """Await `attempt_fn(attempt)` (attempt is 1-based) until it returns, or raise its last failure.

    A failure is retried while `retryable(exc)` (default: `policy.retryable`) holds and attempts remain, or
    the policy's time window has room for the next attempt; `on_retry(attempt, exc, wait)` is called before
    each wait (count retries there).
    """
    should = retryable or policy.retryable
    attempt = 1
    start = time.monotonic()
    while True:
        try:
            return await attempt_fn(attempt)
        except Exception as exc:
            if not should(exc):
                raise
            wait = policy.delay(attempt, getattr(exc, "retry_after", None))
            in_window = policy.window_s is not None and time.monotonic() + wait - start < policy.window_s
            if attempt >= policy.attempts and not in_window:
                raise
            if on_retry is not None:
                on_retry(attempt, exc, wait)
        if wait > 0:
            await asyncio.sleep(wait)
        attempt += 1
