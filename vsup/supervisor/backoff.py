"""When to start a failed instance again, and when to give up on it.

Three keys decide it (restart.*), the rest is derived here:

- `stable_after`: a start counts once the instance has stayed ready that long; its failures
  before are forgotten and the next delay starts over.
- `max_failures`: that many failures in a row, with no start that counted between them, mean a
  crash loop: `on_failure` returns `Decision(delay=None)` (`give_up`) and the instance goes to
  `failed` until someone restarts it (`vsup restart N`, a reload).
- `max_delay`: the longest wait before a restart.

The n-th failure in a row waits FIRST_DELAY × GROWTH^(n−1) plus up to JITTER random seconds (so
instances that failed together do not restart together), the sum capped at `max_delay`; when
`max_delay` is below FIRST_DELAY, every wait is `max_delay`. Delays come from tenacity's wait
strategies. `RestartPolicy` is pure (the caller passes `now`, a `time.monotonic()` reading), so
it is tested without sleeping.
"""

from __future__ import annotations

from dataclasses import dataclass

from tenacity import RetryCallState, Retrying, wait_exponential, wait_random

from vsup.config.schema import RestartConfig

FIRST_DELAY = 1.0  # seconds before the first restart (at most max_delay)
GROWTH = 2.0  # each further failure in a row doubles the delay
JITTER = 1.0  # up to this many random seconds added (at most the first delay)


@dataclass(frozen=True)
class Decision:
    """What to do after a failure: wait `delay` seconds and start again, or give up (crash loop)."""

    delay: float | None  # None: crash loop, go to failed
    attempt: int  # failures in a row since the last start that counted (1 = first)

    @property
    def give_up(self) -> bool:
        return self.delay is None


class RestartPolicy:
    def __init__(self, config: RestartConfig) -> None:
        self.config = config
        first = min(FIRST_DELAY, config.max_delay)
        self._wait = wait_exponential(multiplier=first, exp_base=GROWTH, min=0, max=config.max_delay) + wait_random(
            0, min(JITTER, first))
        self._attempt = 0

    @property
    def attempt(self) -> int:
        return self._attempt

    def reset(self) -> None:
        """Forget past failures: after a start that counted, or when an operator asks for a new chance."""
        self._attempt = 0

    def on_failure(self, now: float, ready_since: float | None) -> Decision:
        """Record one failure at `now`. `ready_since`: when the instance last became ready, if it
        was ready right before this failure (ready for stable_after or longer: the start counted,
        and the failures before it are forgotten first)."""
        if ready_since is not None and now - ready_since >= self.config.stable_after:
            self.reset()
        self._attempt += 1
        if self._attempt >= self.config.max_failures:
            return Decision(None, self._attempt)
        return Decision(self.delay_for(self._attempt), self._attempt)

    def delay_for(self, attempt: int) -> float:
        """The wait before start number `attempt + 1` (attempt 1 = after the first failure)."""
        # tenacity's wait strategies read only attempt_number; the state wants a Retrying to belong to
        state = RetryCallState(Retrying(), None, (), {})
        state.attempt_number = attempt
        return min(self._wait(state), self.config.max_delay)
