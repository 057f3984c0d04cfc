"""The bytes of request bodies the proxy holds at once, proxy-wide (proxy.max_body_buffer).

max_body_bytes bounds one body; nothing bounded them all: 60 connections each sending 8 MiB minus
a byte of a declared 8 MiB body raised the proxy's RSS by 516 MiB, and the connection limits
allow thousands. A body reserves its bytes here before the proxy reads (or buffers) them and
releases them when it is done with them; a body that does not fit is answered 503 with
Retry-After (or streamed on where nothing needs it parsed), so what clients make the proxy hold
stays within `limit` however many connect.

Pure: no I/O, no clock; the caller reserves and releases.
"""

from __future__ import annotations

MiB = 1024**2

# default_limit: 1/512 of the machine's memory, within these. A request body the proxy must
# parse is at most max_body_bytes (8 MiB by default) and most are a few KiB, so 32 MiB holds four
# of the largest at once with room for hundreds of ordinary ones; 1/512 grows that on a large
# host (512 GiB: 1 GiB is capped) without letting clients take a share of memory that matters
# beside the instances' weights and KV caches; 256 MiB (issue 29) is the most the proxy may hold.
DIVISOR = 512
FLOOR = 32 * MiB
CEILING = 256 * MiB


def default_limit(total_memory_bytes: int) -> int:
    """proxy.max_body_buffer's "auto": 1/512 of `total_memory_bytes`, at least 32 MiB, at most
    256 MiB, in whole MiB (24 GiB: 48 MiB; 64 GiB: 128 MiB; 128 GiB and more: 256 MiB)."""
    share = (total_memory_bytes // DIVISOR) // MiB * MiB
    return max(FLOOR, min(CEILING, share))


def configured_limit(setting: int | str | None, max_body_bytes: int, total_memory_bytes: int) -> int:
    """The limit proxy.max_body_buffer sets: its bytes, or for "auto" (and null) default_limit of
    the machine's memory, raised to max_body_bytes if that is more (a body the proxy accepts must
    fit; the schema refuses an explicit value below it)."""
    if isinstance(setting, int):
        return setting
    return max(default_limit(total_memory_bytes), max_body_bytes)


class BodyBudget:
    """Bytes reserved against `limit`: reserve(n) takes n if they fit (all or nothing), release(n)
    gives them back. `peak` is the most held at once since the last reset_peak() (for /metrics
    and the flood bench); `refused` counts reservations that did not fit."""

    __slots__ = ("limit", "held", "peak", "refused")

    def __init__(self, limit: int) -> None:
        if limit < 0:
            raise ValueError(f"the body buffer limit must be 0 or more, not {limit}")
        self.limit = limit
        self.held = 0
        self.peak = 0
        self.refused = 0

    def reserve(self, n: int) -> bool:
        """Take `n` bytes if they fit within the limit; False (nothing taken) if they do not."""
        if n < 0:
            raise ValueError(f"cannot reserve {n} bytes")
        held = self.held + n
        if held > self.limit:
            self.refused += 1
            return False
        self.held = held
        if held > self.peak:
            self.peak = held
        return True

    def release(self, n: int) -> None:
        """Give back `n` bytes reserved before. More than is held is a caller's bug: ValueError,
        and nothing changes (the count never goes negative, which would let more in)."""
        if n < 0 or n > self.held:
            raise ValueError(f"cannot release {n} bytes: {self.held} are held")
        self.held -= n

    @property
    def free(self) -> int:
        return self.limit - self.held

    def reset_peak(self) -> int:
        """The peak so far; from now on the peak is what is held now."""
        peak, self.peak = self.peak, self.held
        return peak
