"""When to start a failed instance again, and when to give up on it.

`RestartPolicy` is pure (the caller passes `now`, a `time.monotonic()` reading), so it is tested
without sleeping. Delays come from tenacity's wait strategies: exponential from
`restart.initial_delay` by `restart.multiplier`, plus up to `restart.jitter` random seconds, the
sum capped at `restart.max_delay`. An instance that stayed ready for `restart.stable_after`
seconds starts over from the initial delay and with an empty crash history. `restart.crash_loop_failures`
failures within `restart.crash_loop_window` seconds mean a crash loop: `on_failure` returns
`Decision(delay=None)` (`give_up`) and the instance goes to `failed` until someone restarts it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from tenacity import RetryCallState, Retrying, wait_exponential, wait_random

from vsup.config.schema import RestartConfig


@dataclass(frozen=True)
class Decision:
    """What to do after a failure: wait `delay` seconds and start again, or give up (crash loop)."""

    delay: float | None  # None: crash loop, go to failed
    attempt: int  # consecutive failures since the last stable period (1 = first)
    failures_in_window: int

    @property
    def give_up(self) -> bool:
        return self.delay is None


class RestartPolicy:
    def __init__(self, config: RestartConfig) -> None:
        self.config = config
        self._wait = wait_exponential(
            multiplier=config.initial_delay, exp_base=config.multiplier, min=0, max=config.max_delay
        ) + wait_random(0, config.jitter)
        self._attempt = 0
        self._failures: deque[float] = deque()

    @property
    def attempt(self) -> int:
        return self._attempt

    def reset(self) -> None:
        """Forget past failures: after a stable period, or when an operator asks for a new chance."""
        self._attempt = 0
        self._failures.clear()

    def on_failure(self, now: float, ready_since: float | None) -> Decision:
        """Record one failure at `now`. `ready_since`: when the instance last became ready, if it
        was ready right before this failure (a long ready period resets the backoff first)."""
        if ready_since is not None and now - ready_since >= self.config.stable_after:
            self.reset()
        self._attempt += 1
        self._failures.append(now)
        window_start = now - self.config.crash_loop_window
        while self._failures and self._failures[0] < window_start:
            self._failures.popleft()
        if len(self._failures) >= self.config.crash_loop_failures:
            return Decision(None, self._attempt, len(self._failures))
        return Decision(self.delay_for(self._attempt), self._attempt, len(self._failures))

    def delay_for(self, attempt: int) -> float:
        """The wait before start number `attempt + 1` (attempt 1 = after the first failure)."""
        # tenacity's wait strategies read only attempt_number; the state wants a Retrying to belong to
        state = RetryCallState(Retrying(), None, (), {})
        state.attempt_number = attempt
        return min(self._wait(state), self.config.max_delay)
